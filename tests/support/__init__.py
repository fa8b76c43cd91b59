"""What the tests share: one ``wait_for`` (:mod:`support.waiting`), one set of message factories
(:mod:`support.messages`), the pipeline harness (:mod:`support.harness`), topic readers (:mod:`support.topics`),
tiny models and configs per role (:mod:`support.trainer`, :mod:`support.scorer`, :mod:`support.producers`) and the
repository's paths (:mod:`support.paths`). Test modules import it as ``support`` (tests/ is on ``sys.path``)."""
