"""The trainer loop's engine interface (:class:`consumers.trainer.engines.TrainEngine`): both engines provide it, and
it names what the loop calls."""

from __future__ import annotations

import torch
from support.trainer import tiny_policy, trainer_cfg

from consumers.trainer.deepspeed_engine import DeepSpeedEngine
from consumers.trainer.engines import TorchEngine, TrainEngine, TrainModule, build_engine

torch.set_num_threads(1)


def protocol_members(proto: type) -> set[str]:
    """The attributes and methods a protocol declares (its own, not ``object``'s or ``Protocol``'s)."""
    methods = {name for name, value in vars(proto).items() if callable(value) and not name.startswith("_")}
    return set(proto.__annotations__) | methods


def test_the_protocol_names_what_the_loop_uses_of_its_engine():
    assert protocol_members(TrainEngine) == {
        "module", "ranks", "device", "lora", "lora_settings", "forward", "backward", "step", "zero_grad",
        "state_dict", "load_state_dict", "policy_state_dict", "full_state", "optimizer_state",
        "load_optimizer_state", "save", "load"}


def test_the_torch_engine_is_a_train_engine_and_an_object_missing_a_member_is_not():
    engine = build_engine(TrainModule(tiny_policy()), trainer_cfg())
    assert isinstance(engine, TorchEngine) and isinstance(engine, TrainEngine)

    class NoStep:  # every member but ``step``
        module, ranks, device, lora, lora_settings = engine.module, engine.ranks, engine.device, False, None

    for name in protocol_members(TrainEngine) - {"step"} - set(TrainEngine.__annotations__):
        setattr(NoStep, name, getattr(TorchEngine, name))
    assert not isinstance(NoStep(), TrainEngine)
    NoStep.step = TorchEngine.step
    assert isinstance(NoStep(), TrainEngine)


def test_the_deepspeed_engine_has_every_member_of_the_protocol():
    """Structurally (building one starts DeepSpeed; tests/integration/test_trainer_deepspeed.py does): every method
    on the class, every attribute declared on it or its base."""
    annotated = {n for klass in DeepSpeedEngine.__mro__ for n in getattr(klass, "__annotations__", {})}
    missing = {name for name in protocol_members(TrainEngine)
               if not hasattr(DeepSpeedEngine, name) and name not in annotated}
    assert missing == set()
