"""Multi-turn episodes on the chat template (producers.chat_turns, producers.multiturn with ``chat``).

A real tokenizer with a real Jinja ChatML template (support.chat) and a tiny real policy (support.chat_model):
replies are rendered as chat messages, the policy's tokens are kept as sampled, and for this template the rollout's
ids are exactly the template's rendering of the whole conversation, with the policy mask on the assistant tokens.
"""

from __future__ import annotations

import pytest
import torch
from support.chat import CHATML_TEMPLATE, IM_END, IM_START, build_chat_tokenizer, render_chatml
from support.chat_model import build_chat_model_dir
from support.multiturn import Scripted

from producers.chat_turns import ChatTurns, TemplateDriftError
from producers.engines.base import Sampling
from producers.environment import Observation, ToolEnvironment
from producers.generate import Turns, produce_rollouts
from producers.multiturn import run_episodes
from schemas import Prompt

torch.set_num_threads(1)

# Qwen3-style: an assistant turn before the last user message loses its <think> block.
STRIPPING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
TRIMMING_TEMPLATE = STRIPPING_TEMPLATE.replace("set content = m['content'] %}", "set content = m['content'] | trim %}")


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def _ids(tokenizer, text):
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_reply_after_a_turn_the_policy_ended_appends_the_rest_of_the_closing_and_the_next_prompt(tokenizer):
    chat = ChatTurns(tokenizer)
    got = chat.reply_tokens([{"role": "user", "content": "hi"}], "ok", True, {"role": "user", "content": "again"})
    # the policy sampled "ok<|im_end|>"; the template closes a turn with "<|im_end|>\n"
    assert got == _ids(tokenizer, f"\n{IM_START}user\nagain{IM_END}\n{IM_START}assistant\n")


def test_a_turn_cut_before_its_end_of_turn_token_gets_the_whole_closing(tokenizer):
    chat = ChatTurns(tokenizer)
    got = chat.reply_tokens([{"role": "user", "content": "hi"}], "ok", False, {"role": "tool", "content": "42"})
    assert got == _ids(tokenizer, f"{IM_END}\n{IM_START}tool\n42{IM_END}\n{IM_START}assistant\n")


def test_template_variables_reach_the_rendering(tokenizer):
    chat = ChatTurns(tokenizer, template_kwargs={"enable_thinking": False})
    got = chat.reply_tokens([{"role": "user", "content": "hi"}], "ok", True, {"role": "user", "content": "x"})
    assert got == _ids(tokenizer, f"\n{IM_START}user\nx{IM_END}\n{IM_START}assistant\n<think>\n\n</think>\n\n")


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_reason(tokenizer):
    chat = ChatTurns(tokenizer, template=STRIPPING_TEMPLATE)
    conversation = [{"role": "user", "content": "hi"}]
    # no <think> block: the template appends only, and the reply renders
    assert chat.reply_tokens(conversation, "ok", True, {"role": "user", "content": "x"})
    with pytest.raises(TemplateDriftError, match="rewrites the conversation when a turn is added"):
        chat.reply_tokens(conversation, "<think>a</think>ok", True, {"role": "user", "content": "x"})


def test_a_template_that_does_not_write_the_assistant_text_verbatim_is_refused(tokenizer):
    chat = ChatTurns(tokenizer, template=TRIMMING_TEMPLATE)
    with pytest.raises(TemplateDriftError, match="verbatim"):
        chat.reply_tokens([{"role": "user", "content": "hi"}], "ok ", True, {"role": "user", "content": "x"})


def test_a_reply_role_must_be_user_or_tool(tokenizer):
    with pytest.raises(ValueError, match="role must be one of user, tool"):
        ChatTurns(tokenizer).reply_tokens([], "ok", True, {"role": "system", "content": "x"})
    with pytest.raises(ValueError, match="Observation.role"):
        Observation("x", role="assistant")
    assert ToolEnvironment(lambda text: "42", "calc").step("2*21").role == "tool"


@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory):
    from producers.engines.hf import HFEngine

    return HFEngine.from_dir(build_chat_model_dir(tmp_path_factory.mktemp("chat") / "policy"))


def _chat_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+34?"}]
    text = render_chatml(messages)
    return Prompt(prompt_id="chat-1", epoch=0, text=text, answer="46", group_size=6, messages=messages,
                  prompt_token_ids=torch.tensor(_ids(tokenizer, text), dtype=torch.int32).numpy())


def _expected_ids(tokenizer, messages, episode):
    """The template's rendering of the whole conversation the episode played, as ids (the last policy turn ended
    with its sampled <|im_end|>, or was cut: by the budget, or because a reply left no room for another turn)."""
    conversation = list(messages)
    for turn, text in zip(episode.turns, episode.texts, strict=True):
        conversation.append({"role": "assistant" if turn["role"] == "policy" else "user", "content": text})
    rendered = render_chatml(conversation, add_generation_prompt=False)
    if episode.token_ids[-1] == tokenizer.convert_tokens_to_ids(IM_END):
        return _ids(tokenizer, rendered.removesuffix("\n"))  # the last turn ends at its sampled <|im_end|>
    last = conversation.pop()  # cut at the budget: the template's prompt for it, then its text
    return _ids(tokenizer, render_chatml(conversation) + last["content"])


def test_a_chat_episode_is_the_templates_rendering_of_the_conversation_with_the_mask_on_assistant_tokens(
        chat_engine):
    tokenizer = chat_engine.tokenizer
    prompt = _chat_prompt(tokenizer)
    out = run_episodes(chat_engine, [prompt], [[int(t) for t in prompt.prompt_token_ids]], 6, sampling=Sampling(1.0),
                       max_new_tokens=60, seed=3, make_env=lambda: Scripted(["Try again.", "Last try."]),
                       max_turns=3, chat=ChatTurns(tokenizer))
    # a random policy may sample a special token (<unk>, <pad>) inside a turn, which the turn's decoded text then
    # lacks; the property is about the template, so it is checked on the episodes whose turns spell their text
    specials = {tokenizer.convert_tokens_to_ids(t) for t in ("<pad>", "<unk>", IM_START)}
    episodes = [e for e in out[0] if not specials & {t for t, m in zip(e.token_ids, e.policy_mask) if m}]
    multi = [e for e in episodes if len(e.turns) >= 3]
    assert multi, "no clean episode took more than one policy turn; the tiny policy's eos boost no longer works"
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    for episode in episodes:
        ids = [int(t) for t in prompt.prompt_token_ids] + episode.token_ids
        assert ids == _expected_ids(tokenizer, prompt.messages, episode)
        # the mask covers exactly the assistant tokens: each policy turn's text and its sampled <|im_end|>
        policy = [t for t, m in zip(episode.token_ids, episode.policy_mask, strict=True) if m]
        ended = episode.token_ids[-1] == im_end
        spelled = "".join(text + (IM_END if i < len(episode.texts) - 1 or ended else "")
                          for i, text in enumerate(episode.texts) if i % 2 == 0)
        assert policy == _ids(tokenizer, spelled)
        env = [t for t, m in zip(episode.token_ids, episode.policy_mask, strict=True) if not m]
        assert env.count(im_end) == len(episode.texts) // 2  # each reply closes the assistant turn before it


def test_a_drifting_template_dead_letters_the_prompt_with_the_reason(chat_engine):
    tokenizer = chat_engine.tokenizer
    prompt = _chat_prompt(tokenizer)
    counting = "{{ '#' ~ (messages | length) ~ '\\n' }}" + CHATML_TEMPLATE  # the first line changes with every turn
    turns = Turns(lambda: Scripted(["again"]), 2, chat_template=counting)
    result = produce_rollouts([prompt], chat_engine, producer_id="p", sampling=Sampling(1.0), max_new_tokens=40, seed=3,
                              turns=turns)
    assert result.rollouts == []
    assert [r.index for r in result.rejected] == [0]
    assert result.rejected[0].reason.startswith("chat template: the chat template rewrites the conversation")


def test_plain_text_prompts_keep_plain_text_replies(chat_engine):
    tokenizer = chat_engine.tokenizer
    prompt = Prompt(prompt_id="plain", epoch=0, text="12+34=", answer="46", group_size=2)
    ids = _ids(tokenizer, prompt.text)
    out = run_episodes(chat_engine, [prompt], [ids], 2, sampling=Sampling(1.0), max_new_tokens=40, seed=3,
                       make_env=lambda: Scripted(["hint"]), max_turns=2, chat=ChatTurns(tokenizer))
    for episode in out[0]:
        if len(episode.turns) > 1:
            env = [t for t, m in zip(episode.token_ids, episode.policy_mask, strict=True) if not m]
            assert env == _ids(tokenizer, "hint")
