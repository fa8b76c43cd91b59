"""Multi-turn episodes on the chat template (producers.chat_turns, producers.multiturn with ``chat``).

A real tokenizer with real Jinja templates (support.chat: ChatML, and the verbatim or hand-written templates of
tests/support/templates/, SOURCES.md) and a tiny real policy (support.chat_model): replies are rendered as chat
messages, the policy's tokens are kept as sampled, a rollout's ids are exactly the template's rendering of the
whole conversation with the policy mask on the assistant tokens, or the prompt is refused with the true reason; a
turn ends at the template's own end-of-turn token.
"""

from __future__ import annotations

import functools

import pytest
import torch
from support.chat import (
    CHATML_TEMPLATE,
    IM_END,
    IM_START,
    build_chat_tokenizer,
    build_template_tokenizer,
    render_chatml,
)
from support.chat_model import build_chat_model_dir, chat_llama_config
from support.multiturn import Scripted, ScriptedChatEngine

from producers.chat_turns import ChatTurns, TemplateDriftError
from producers.engines.base import Sampling
from producers.environment import Observation, ToolEnvironment
from producers.step import Turns, produce_rollouts
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
    # enable_thinking=False (Qwen3's) writes an empty think block in the generation prompt only: the policy would be
    # conditioned on text the rendering of its turn lacks, so the variable reaching the template refuses the turn
    chat = ChatTurns(tokenizer, template_kwargs={"enable_thinking": False})
    with pytest.raises(TemplateDriftError, match=r"generation prompt adds '<think>\\n\\n</think>\\n\\n'"):
        chat.reply_tokens([{"role": "user", "content": "hi"}], "ok", True, {"role": "user", "content": "x"})
    assert ChatTurns(tokenizer, template_kwargs={"enable_thinking": True}).reply_tokens(
        [{"role": "user", "content": "hi"}], "ok", True, {"role": "user", "content": "x"}) == _ids(
        tokenizer, f"\n{IM_START}user\nx{IM_END}\n{IM_START}assistant\n")


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_reason(tokenizer):
    chat = ChatTurns(tokenizer, template=STRIPPING_TEMPLATE)
    conversation = [{"role": "user", "content": "hi"}]
    # no <think> block: the template appends only, and the reply renders
    assert chat.reply_tokens(conversation, "ok", True, {"role": "user", "content": "x"})
    with pytest.raises(TemplateDriftError, match="moves or rewrites an earlier message when a turn is added"):
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
    # refused before anything is generated: the template's first line changes whatever the policy writes
    assert result.rejected[0].reason.startswith("chat template: the template moves or rewrites an earlier message")


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


# -- the templates of real models (tests/support/templates/SOURCES.md) ------------------------------------------------

QUESTION = [{"role": "user", "content": "What is 2+2?"}]
WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, *QUESTION]
AGAIN = {"role": "user", "content": "Sure?"}


@functools.cache
def _template(name):
    return build_template_tokenizer(name)


def test_deepseek_r1s_think_generation_prompt_is_refused_naming_it():
    chat = ChatTurns(_template("deepseek-r1-distill"))  # verbatim
    # the policy was conditioned on "<｜Assistant｜><think>\n"; the template renders the turn without "<think>\n"
    with pytest.raises(TemplateDriftError, match=r"generation prompt adds '<think>\\n' .*DeepSeek-R1-style"):
        chat.reply_tokens(QUESTION, "4", True, AGAIN)
    with pytest.raises(TemplateDriftError, match="DeepSeek-R1-style"):
        chat.check(QUESTION)


def test_mistrals_system_message_moving_to_the_last_user_turn_is_refused_naming_it():
    tokenizer = _template("mistral-v0.3-like")
    chat = ChatTurns(tokenizer)
    for call in (lambda: chat.reply_tokens(WITH_SYSTEM, " 4", True, AGAIN), lambda: chat.check(WITH_SYSTEM)):
        with pytest.raises(TemplateDriftError, match=r"moves or rewrites an earlier message .*'Be brief"):
            call()
    # without a system message a turn the template writes as ' ' + text renders faithfully
    assert chat.reply_tokens(QUESTION, " 4", True, AGAIN) == _ids(tokenizer, "[INST] Sure?[/INST]")
    chat.check(QUESTION)


def test_phi35s_eos_after_the_last_turn_is_refused_with_the_true_reason():
    chat = ChatTurns(_template("phi-3.5"))  # verbatim
    with pytest.raises(TemplateDriftError) as refused:
        chat.reply_tokens(QUESTION, "4", True, AGAIN)
    assert "ends a conversation without a generation prompt with '<|endoftext|>' (Phi-3.5-style" in str(refused.value)
    assert "Qwen3" not in str(refused.value) and "<think>" not in str(refused.value)


@pytest.mark.parametrize(("name", "end"), [
    ("chatml", "<|im_end|>"), ("qwen2.5", "<|im_end|>"), ("phi-4", "<|im_end|>"), ("llama-3.1-like", "<|eot_id|>"),
    ("gemma-2-like", "<end_of_turn>"), ("phi-3.5", "<|end|>"), ("mistral-v0.3-like", "</s>")])
def test_the_end_of_turn_token_is_the_templates_own_not_the_eos(name, end):
    tokenizer = _template(name)
    assert ChatTurns(tokenizer).end_of_turn(QUESTION) == (end, tokenizer.convert_tokens_to_ids(end))


def test_a_gemma_turn_that_sampled_its_end_of_turn_token_does_not_get_it_again():
    tokenizer = _template("gemma-2-like")  # eos is <eos>; a turn ends with <end_of_turn>
    chat = ChatTurns(tokenizer)
    rest = "\n<start_of_turn>user\nSure?<end_of_turn>\n<start_of_turn>model\n"
    assert chat.reply_tokens(QUESTION, "4", True, AGAIN) == _ids(tokenizer, rest)
    assert chat.reply_tokens(QUESTION, "4", False, AGAIN) == _ids(tokenizer, "<end_of_turn>" + rest)


def _conversational(tokenizer, messages, prompt_id="chat-1"):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = _ids(tokenizer, text)
    return Prompt(prompt_id=prompt_id, epoch=0, text=text, answer="4", group_size=2, messages=messages,
                  prompt_token_ids=torch.tensor(ids, dtype=torch.int32).numpy()), ids


def _played(messages, episode):
    return [*messages, *({"role": "assistant" if t["role"] == "policy" else "user", "content": text}
                         for t, text in zip(episode.turns, episode.texts, strict=True))]


def _gemma_episode(sampling):
    """One 2-turn Gemma-like episode of a policy that would write on after its end of turn; (engine, episode, the
    ids the template renders for that conversation, the prompt's ids)."""
    tokenizer = _template("gemma-2-like")
    prompt, ids = _conversational(tokenizer, QUESTION)
    engine = ScriptedChatEngine(tokenizer, ["4<end_of_turn>\nmore", "5<end_of_turn>\nmore"])
    out = run_episodes(engine, [prompt], [ids], 1, sampling=sampling, max_new_tokens=80, seed=0,
                       make_env=lambda: Scripted(["Sure?"]), max_turns=2, chat=ChatTurns(tokenizer))
    rendered = ChatTurns(tokenizer).render(QUESTION + [{"role": "assistant", "content": "4"}, AGAIN,
                                                       {"role": "assistant", "content": "5"}], generation_prompt=False)
    return engine, out[0][0], _ids(tokenizer, rendered.removesuffix("\n")), ids  # the last turn ends at its token


def test_generation_stops_at_the_templates_end_of_turn_token_by_default():
    end = _template("gemma-2-like").convert_tokens_to_ids("<end_of_turn>")  # eos is <eos>
    engine, episode, expected, ids = _gemma_episode(Sampling(1.0))
    assert [s.stop_token_ids for s in engine.samplings] == [(end,), (end,)]
    assert ids + episode.token_ids == expected


def test_a_turn_that_stopped_at_an_explicit_end_of_turn_stop_id_does_not_get_it_appended_again():
    end = _template("gemma-2-like").convert_tokens_to_ids("<end_of_turn>")
    engine, episode, expected, ids = _gemma_episode(Sampling(1.0, stop_token_ids=(end,)))  # producer.stop_token_ids
    assert ids + episode.token_ids == expected and episode.token_ids.count(end) == 3  # 2 turns + the reply's own
    other = _template("gemma-2-like").convert_tokens_to_ids("<bos>")
    engine, episode, _, _ = _gemma_episode(Sampling(1.0, stop_token_ids=(other,)))  # set without it: it wins
    assert engine.samplings[0].stop_token_ids == (other,) and episode.finish_reason == "length"


def test_a_prompt_the_template_cannot_continue_is_refused_before_generating():
    tokenizer = _template("deepseek-r1-distill")
    prompt, ids = _conversational(tokenizer, QUESTION)
    engine = ScriptedChatEngine(tokenizer, ["4<｜end▁of▁sentence｜>"])
    out = run_episodes(engine, [prompt], [ids], 2, sampling=Sampling(1.0), max_new_tokens=40, seed=0,
                       make_env=lambda: Scripted(["Sure?"]), max_turns=2, chat=ChatTurns(tokenizer))
    assert isinstance(out[0], str) and out[0].startswith("chat template: the generation prompt adds '<think>\\n'")
    assert engine.samplings == []  # nothing was generated for it


def test_a_prompt_whose_ids_are_not_the_templates_rendering_of_its_messages_is_refused_before_generating():
    tokenizer = _template("qwen2.5")
    tools = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {}}}]
    text = tokenizer.apply_chat_template(QUESTION, tools=tools, tokenize=False, add_generation_prompt=True)
    prompt, _ = _conversational(tokenizer, QUESTION)  # the wire carries the messages, not the tools
    ids = _ids(tokenizer, text)  # the ids published: rendered with the tools
    engine = ScriptedChatEngine(tokenizer, ["4<|im_end|>"])
    out = run_episodes(engine, [prompt], [ids], 2, sampling=Sampling(1.0), max_new_tokens=40, seed=0,
                       make_env=lambda: Scripted(["Sure?"]), max_turns=2, chat=ChatTurns(tokenizer))
    assert out[0].startswith("chat template: the prompt's token ids are not this template's rendering of its")
    assert engine.samplings == []


@pytest.mark.parametrize("name", ["chatml", "qwen2.5", "llama-3.1-like", "phi-4"])
def test_a_three_turn_episode_is_the_templates_rendering_with_the_mask_on_the_assistant_tokens(name):
    tokenizer = _template(name)
    chat = ChatTurns(tokenizer)
    end = chat.end_of_turn(WITH_SYSTEM)[0]
    prompt, ids = _conversational(tokenizer, WITH_SYSTEM)
    engine = ScriptedChatEngine(tokenizer, [f"4{end}", f"It is 4.{end}", f"Yes: 4{end}"])
    out = run_episodes(engine, [prompt], [ids], 2, sampling=Sampling(1.0), max_new_tokens=200, seed=0,
                       make_env=lambda: Scripted(["Sure?", "Really sure?"]), max_turns=3, chat=chat)
    for episode in out[0]:
        assert [t["role"] for t in episode.turns] == ["policy", "env", "policy", "env", "policy"]
        rendered = chat.render(_played(WITH_SYSTEM, episode), generation_prompt=False)
        assert ids + episode.token_ids == _ids(tokenizer, rendered[:rendered.rindex(end) + len(end)])
        policy = [t for t, m in zip(episode.token_ids, episode.policy_mask, strict=True) if m]
        assert policy == _ids(tokenizer, f"4{end}It is 4.{end}Yes: 4{end}")


def _policy_turns(episode):
    """The token ids of each policy turn (each run of 1s of the policy mask)."""
    turns, previous = [], 0
    for token, bit in zip(episode.token_ids, episode.policy_mask, strict=True):
        if bit and not previous:
            turns.append([])
        if bit:
            turns[-1].append(token)
        previous = bit
    return turns


@pytest.fixture(scope="module")
def gemma_engine(tmp_path_factory):
    """A tiny random policy over the Gemma-2-like tokenizer whose <end_of_turn> is as likely as its most sampled
    token; its eos (<eos>) and the other markers are unlikely, so only the end-of-turn token can end a turn early."""
    from transformers import LlamaForCausalLM

    from producers.engines.hf import HFEngine

    tokenizer = _template("gemma-2-like")
    torch.manual_seed(0)
    model = LlamaForCausalLM(chat_llama_config(tokenizer))
    with torch.no_grad():
        head = model.lm_head.weight  # [V, H]
        head.mul_(8.0)
        ids = torch.tensor([_conversational(tokenizer, QUESTION)[1]])
        favourite = int(model(ids).logits[0].mean(dim=0).argmax())
        head[tokenizer.convert_tokens_to_ids("<end_of_turn>")] = head[favourite]
        for special in ("<pad>", "<unk>", IM_START, IM_END, "<bos>", "<eos>", "<start_of_turn>"):
            head[tokenizer.convert_tokens_to_ids(special)] = -head[favourite]
    path = tmp_path_factory.mktemp("gemma") / "policy"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return HFEngine.from_dir(path)


def test_the_hf_engine_ends_a_turn_at_the_templates_end_of_turn_token(gemma_engine):
    tokenizer = gemma_engine.tokenizer
    chat, end = ChatTurns(tokenizer), tokenizer.convert_tokens_to_ids("<end_of_turn>")
    prompt, ids = _conversational(tokenizer, QUESTION)
    out = run_episodes(gemma_engine, [prompt], [ids], 6, sampling=Sampling(1.0), max_new_tokens=60, seed=3,
                       make_env=lambda: Scripted(["Try again.", "Last try."]), max_turns=3, chat=chat)
    assert any(len(e.turns) >= 3 for e in out[0]), "no episode took a second policy turn: turns never ended"
    specials, clean = set(tokenizer.added_tokens_decoder), 0  # every marker of this vocabulary is special
    for episode in out[0]:
        turns = _policy_turns(episode)
        assert all(end not in turn[:-1] for turn in turns)  # a turn never goes on past <end_of_turn>
        assert all(turn[-1] == end for turn in turns[:-1])  # every turn but a last one cut at the budget ends there
        if any(t in specials for turn in turns for t in turn if t != end):
            continue  # a special token sampled inside a turn is not in its decoded text (chat_turns' limit)
        clean += len(turns) > 1
        played = _played(QUESTION, episode)
        if episode.token_ids[-1] == end:
            rendered = chat.render(played, generation_prompt=False)
            expected = rendered[:rendered.rindex("<end_of_turn>") + len("<end_of_turn>")]
        else:  # the last turn was cut at the budget
            expected = chat.render(played[:-1], generation_prompt=True) + played[-1]["content"]
        assert ids + episode.token_ids == _ids(tokenizer, expected)
    assert clean, "no multi-turn episode spelled its turns' text: the property was not checked"
