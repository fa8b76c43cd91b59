"""The built-in demo: two-digit addition learned by a ~1 M-parameter Llama on a character-level tokenizer.

Modules (imported directly; this package imports nothing so that `stream_rl.demo.task:addition_reward` stays a
light reference):

- `tokenizer`: `build_tokenizer()`, the character-level tokenizer.
- `model`: `build_policy`, `build_reward_model`, `demo_config`: tiny Llama models built from a config.
- `task`: `make_prompts`, `addition_reward` (the rule-based verifier), the fixed train/eval split.
- `retry`: the multi-turn variant, a second try after a hint.
- `chat_model`: a tiny chat model with a real chat template, to try the chat path with no download.
- `sft`: `supervised_warm_start`, `SFTConfig`, `SFTResult`, and sampling/accuracy helpers.
- `reward_model`: `train_reward_model`, the optional learned reward model (frozen body, fitted head).
- `init`: `init_demo(dir, seed=0, ...)`, which builds all of the above into one directory; `progress`: its output.
"""
