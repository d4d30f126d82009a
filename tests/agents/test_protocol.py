"""Agent protocol: action parsing (cases, fuzz, round trip), stop strings, prompt rendering."""

import random

import pytest

from joyagents_jax.agents import protocol
from joyagents_jax.agents.protocol import (
    PARSE_ERROR_KINDS, STOP_STRINGS, TRUNCATION_MARK, AgentSpec, Answer, Call, Hint, ParseError,
    ToolCall, format_observation, parse_action, render_action, render_messages, render_prompt,
    stop_strings, system_prompt)
from joyagents_jax.tokenizers import ByteTokenizer, HFTokenizer

MASTER = AgentSpec("master", "Route the request.", ("qa", "efc", "gfc", "math"))
MATH = AgentSpec("math", "Solve with the calculator.", ("calculator",))


# ------------------------------------------------------------------------------------------------
# Parsing: hand cases.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, role, expected", [
    ('<call agent="qa"/>', "master", Call("qa")),
    ('<call agent="qa" />', "master", Call("qa")),
    ('<call agent="qa">price of X?</call>', "master", Call("qa", "price of X?")),
    ('<call agent="qa"></call>', "master", Call("qa", "")),
    ('<call agent="nobody"/>', "master", Call("nobody")),  # Names are the engine's business.
    ("<answer>42</answer>", "master", Answer("42")),
    ("<answer>42</answer>", "sub", Answer("42")),
    ("<answer></answer>", "sub", Answer("")),
    ("<answer> a < b, 3 > 2 </answer>", "sub", Answer(" a < b, 3 > 2 ")),  # Kept verbatim.
    ('<tool name="calculator">{"expr": "3/4"}</tool>', "sub",
     ToolCall("calculator", {"expr": "3/4"})),
    ('<tool name="kb_search">{"q": {"a": [1, 2.5, null, true]}}</tool>', "sub",
     ToolCall("kb_search", {"q": {"a": [1, 2.5, None, True]}})),
    ('<tool name="x"> {} </tool>', "sub", ToolCall("x", {})),
    ('<tool name="web">{"url": "a\\"/>b", "t": "<\\/tool>"}</tool>', "sub",
     ToolCall("web", {"url": 'a"/>b', "t": "</tool>"})),
    ("<think>route it</think><call agent=\"math\"/>", "master", Call("math", think="route it")),
    ("<think></think>\n <answer>x</answer>", "sub", Answer("x", think="")),
    ("<think>use <tool> here</think><answer>x</answer>", "sub",
     Answer("x", think="use <tool> here")),
    ("  \n<answer>x</answer>\n ", "sub", Answer("x")),
    ("<answer>x</answer><|im_end|>", "sub", Answer("x")),
    ("<answer>x</answer> <|im_end|>\n<|endoftext|><|endoftext|>", "sub", Answer("x")),
])
def test_parse_valid(text, role, expected):
    assert parse_action(text, role) == expected


ERROR_CASES = [
    ("", "sub", "empty"),
    (" \n\t", "master", "empty"),
    ("<|im_end|>", "master", "empty"),
    ("42", "sub", "no_action"),
    ("<3 you", "sub", "no_action"),
    ("<think>hmm</think>", "sub", "no_action"),
    ("<think>hmm</think> the answer is 4", "sub", "no_action"),
    ("Sure! <answer>4</answer>", "sub", "leading_text"),
    ("<think>a</think>so <call agent=\"qa\"/>", "master", "leading_text"),
    ("<think>a</think><think>b</think><answer>4</answer>", "sub", "misplaced_think"),
    ('<answer>4</answer><think>b</think>', "sub", "trailing_text"),
    ("<observation>4</observation>", "sub", "unknown_tag"),
    ("<Answer>4</Answer>", "sub", "unknown_tag"),
    ("</answer>", "sub", "unknown_tag"),
    ('<tool name="calculator">{"expr": "1"}</tool>', "master", "wrong_role"),
    ('<call agent="qa"/>', "sub", "wrong_role"),
    ("<call>x</call>", "master", "bad_tag"),
    ('<call agent="">x</call>', "master", "bad_tag"),
    ('<call agent="q a"/>', "master", "bad_tag"),
    ("<call agent='qa'/>", "master", "bad_tag"),
    ('<tool name="calc"/>', "sub", "bad_tag"),
    ('<tool>{"a": 1}</tool>', "sub", "bad_tag"),
    ("<answer x=\"1\">4</answer>", "sub", "bad_tag"),
    ("<think x>a</think><answer>4</answer>", "sub", "bad_tag"),
    ("<answer>4", "sub", "unclosed"),
    ('<call agent="qa">what is', "master", "unclosed"),
    ('<tool name="calc">{"expr": "1"}', "sub", "unclosed"),
    ("<think>never closed <answer>4</answer>", "sub", "unclosed"),
    ("<answer>a<answer>b</answer>", "sub", "nested_tag"),
    ('<call agent="qa">x <call agent="math"/></call>', "master", "nested_tag"),
    ("<think>a<think>b</think><answer>4</answer>", "sub", "nested_tag"),
    ('<tool name="calc">{"expr": 3 +}</tool>', "sub", "bad_json"),
    ('<tool name="calc"></tool>', "sub", "bad_json"),
    ('<tool name="calc">' + "[" * 100_000 + "</tool>", "sub", "bad_json"),  # RecursionError.
    ('<tool name="calc">' + "1" * 5000 + "</tool>", "sub", "bad_json"),  # Int digit limit.
    ('<tool name="calc">[1, 2]</tool>', "sub", "args_not_object"),
    ('<tool name="calc">"3+4"</tool>', "sub", "args_not_object"),
    ("<answer>4</answer> because", "sub", "trailing_text"),
    ("<answer>4</answer><answer>5</answer>", "sub", "multiple_actions"),
    ('<call agent="qa"/><call agent="math"/>', "master", "multiple_actions"),
]


@pytest.mark.parametrize("text, role, kind", ERROR_CASES)
def test_parse_errors(text, role, kind):
    result = parse_action(text, role)
    assert isinstance(result, ParseError) and result.kind == kind, result
    assert isinstance(result.detail, str) and len(result.detail) < 200


def test_error_cases_cover_every_kind():
    assert {kind for _, _, kind in ERROR_CASES} == set(PARSE_ERROR_KINDS)


def test_unknown_role_raises():
    with pytest.raises(ValueError, match="Unknown role 'boss'"):
        parse_action("<answer>1</answer>", "boss")
    with pytest.raises(ValueError, match="Unknown role"):
        stop_strings("boss")


# ------------------------------------------------------------------------------------------------
# Parsing: fuzz. Whatever the text, the parser returns a value.
# ------------------------------------------------------------------------------------------------

PIECES = ["<think>", "</think>", "<answer>", "</answer>", '<call agent="qa"', '<call agent="',
          "</call>", '<tool name="calc">', "</tool>", "/>", ">", "<", '"', "{", "}", "[", "]",
          ":", ",", "'", "\\", "a", " ", "\n", "1", "é", "🤖", "\x00", "<|im_end|>", "\ud800"]


def _random_text(rng: random.Random) -> str:
    mode = rng.randrange(3)
    if mode == 0:  # Tag soup.
        return "".join(rng.choice(PIECES) for _ in range(rng.randrange(30)))
    if mode == 1:  # Random bytes, as a tokenizer's decode would return them.
        return bytes(rng.randrange(256) for _ in range(rng.randrange(60))).decode(
            "utf-8", errors="replace")
    text = render_action(rng.choice(VALID_ACTIONS))  # A valid action, mutated.
    i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
    return text[:i] + rng.choice(PIECES + [""]) + text[j:]


VALID_ACTIONS = [Call("qa"), Call("math", "3 + 4?", think="t"), Answer("4"),
                 ToolCall("calculator", {"expr": "3/4", "n": [1, {"k": None}]}, think="")]


def test_fuzz_never_raises():
    rng = random.Random(0)
    kinds = set()
    for _ in range(3000):
        text = _random_text(rng)
        for role in ("master", "sub"):
            result = parse_action(text, role)
            assert isinstance(result, (Call, ToolCall, Answer, ParseError)), (text, result)
            if isinstance(result, ParseError):
                assert result.kind in PARSE_ERROR_KINDS
                kinds.add(result.kind)
    assert len(kinds) >= 10  # The fuzz reaches most failure paths.


def test_every_prefix_of_a_valid_action_parses_to_a_value():
    for action in VALID_ACTIONS:
        text = render_action(action)
        for i in range(len(text) + 1):
            for role in ("master", "sub"):
                assert isinstance(parse_action(text[:i], role),
                                  (Call, ToolCall, Answer, ParseError))


@pytest.mark.parametrize("text", [" " * 200_000 + "x", "<|im_end|>" * 50_000,
                                  "<answer>" + "<" * 200_000, '<call agent="' + "a" * 200_000])
def test_hostile_long_inputs_are_fast(text):
    assert isinstance(parse_action(text, "master"), ParseError)  # Linear time: no timeout.


# ------------------------------------------------------------------------------------------------
# Rendering: round trip and stop strings.
# ------------------------------------------------------------------------------------------------

TEXT_PIECES = ["a", "B", " ", "\n", "7", "é", "<", ">", "/", '"', "'", "{", "}", "&", "<b>",
               "</", "</answer>", "</call>", "</think>", "<think>", '"/>', "<answer>", "<call"]
NAME_CHARS = "abcXYZ_-.:019/é"


def _random_content(rng: random.Random) -> str:
    return "".join(rng.choice(TEXT_PIECES) for _ in range(rng.randrange(12)))


def _random_json(rng: random.Random, depth: int = 0):
    choice = rng.randrange(8 if depth < 3 else 5)
    if choice == 0:
        return rng.randrange(-10**6, 10**6)
    if choice == 1:
        return rng.uniform(-1e3, 1e3)
    if choice == 2:
        return _random_content(rng)
    if choice == 3:
        return rng.choice([True, False, None])
    if choice == 4:
        return 10**30  # Beyond float range.
    if choice == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {_random_content(rng): _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def _random_action(rng: random.Random):
    name = "".join(rng.choice(NAME_CHARS) for _ in range(rng.randrange(1, 10)))
    think = rng.choice([None, _random_content(rng)])
    kind = rng.randrange(4)
    if kind == 0:
        return Call(name, None, think)
    if kind == 1:
        return Call(name, _random_content(rng), think)
    if kind == 2:
        return ToolCall(name, {_random_content(rng): _random_json(rng) for _ in range(3)}, think)
    return Answer(_random_content(rng), think)


def _roles(action) -> tuple[str, ...]:
    return {Call: ("master",), ToolCall: ("sub",), Answer: ("master", "sub")}[type(action)]


def _sampler_cut(text: str, role: str) -> int:
    """Where a sampler that stops on `stop_strings(role)` would end `text`."""
    return min((text.find(s) + len(s) for s in stop_strings(role) if s in text), default=-1)


def test_round_trip_property():
    rng = random.Random(1)
    rendered = 0
    for _ in range(3000):
        action = _random_action(rng)
        try:
            text = render_action(action)
        except ValueError:
            contents = [action.think or ""] + [getattr(action, f, None) or ""
                                               for f in ("text", "query")]
            assert any(bad in c for c in contents
                       for bad in ("</", "<think", "<answer", "<call", '"/>')), action
            continue
        rendered += 1
        for role in _roles(action):
            assert parse_action(text, role) == action
            assert _sampler_cut(text, role) == len(text)  # The node ends exactly here.
    assert rendered > 1000


@pytest.mark.parametrize("action, text", [
    (Call("qa"), '<call agent="qa"/>'),
    (Call("qa", "price?", think="x"), '<think>x</think><call agent="qa">price?</call>'),
    (Answer("4", think=""), "<think></think><answer>4</answer>"),
    (ToolCall("calculator", {"expr": "3/4", "n": [1, 2.5]}),
     '<tool name="calculator">{"expr":"3/4","n":[1,2.5]}</tool>'),
    (ToolCall("kb", {"q": "café </tool>"}), '<tool name="kb">{"q":"café <\\/tool>"}</tool>'),
])
def test_render_exact(action, text):
    assert render_action(action) == text
    assert parse_action(text, _roles(action)[0]) == action


@pytest.mark.parametrize("action", [
    Answer("a</answer>"), Answer("a <answer> b"), Answer('<br class="x"/>'),  # "/> stops a master.
    Call("q a"), Call('q"a'), Call(""), Call("qa", "x</call>"), Call("qa", 'say "hi"/> now'),
    Call("qa", think="a</think>"), Call("qa", think="</answer>"),
    ToolCall("t", {"x": float("nan")}),
    ToolCall("t", {1: "int key"}), ToolCall("t<", {}),
])
def test_render_rejects_what_cannot_round_trip(action):
    with pytest.raises(ValueError):
        render_action(action)


def test_stop_strings():
    assert stop_strings("master") == ("</call>", '"/>', "</answer>")
    assert stop_strings("sub") == ("</tool>", "</answer>")  # "/> may occur inside JSON args.
    assert set(STOP_STRINGS) == set(stop_strings("master")) | set(stop_strings("sub"))
    args = render_action(ToolCall("web", {"html": '<br class="x"/> ok'}))
    assert _sampler_cut(args, "sub") == len(args)


# ------------------------------------------------------------------------------------------------
# Prompts.
# ------------------------------------------------------------------------------------------------


def test_system_prompt():
    assert system_prompt(MASTER) == "Route the request.\nAgents: qa, efc, gfc, math"
    assert system_prompt(MATH) == "Solve with the calculator.\nTools: calculator"
    assert system_prompt(AgentSpec("qa", "Answer.")) == "Answer."
    assert MASTER.role == "master" and MATH.role == "sub"
    assert system_prompt(MATH, Hint("2+2?", '<tool name="calculator">{"expr":"2+2"}</tool>')) == (
        "Solve with the calculator.\nTools: calculator\nSimilar past request: 2+2?\n"
        'Good response: <tool name="calculator">{"expr":"2+2"}</tool>')


def test_render_messages():
    call = '<call agent="math"/>'
    assert render_messages(MASTER, "Q?", [(call, "7")], observation_role="tool") == [
        {"role": "system", "content": "Route the request.\nAgents: qa, efc, gfc, math"},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "7"},
    ]


def test_byte_prompt_master():
    prompt = render_prompt(ByteTokenizer(), MASTER, "What is 3 + 4?")
    assert prompt == ("<|im_start|>system\nRoute the request.\nAgents: qa, efc, gfc, math"
                      "<|im_end|>\n<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert len(ByteTokenizer().encode(prompt)) == 88  # Byte-tokenizer ids.


def test_byte_prompt_sub_agent_with_observation_and_hint():
    tool = '<tool name="calculator">{"expr":"3+4"}</tool>'
    prompt = render_prompt(ByteTokenizer(), MATH, "What is 3 + 4?", [(tool, "7")],
                           hint=Hint("What is 2 + 2?", "<answer>4</answer>"))
    assert prompt == (
        "<|im_start|>system\nSolve with the calculator.\nTools: calculator\n"
        "Similar past request: What is 2 + 2?\nGood response: <answer>4</answer><|im_end|>\n"
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
        f"<|im_start|>assistant\n{tool}<|im_end|>\n"
        "<|im_start|>observation\n7<|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def qwen25_tokenizer(qwen25_tokenizer_dir):
    return HFTokenizer(qwen25_tokenizer_dir)


def test_qwen25_prompt(qwen25_tokenizer):
    tok = qwen25_tokenizer
    tool = '<tool name="calculator">{"expr":"3+4"}</tool>'
    prompt = render_prompt(tok, MATH, "What is 3 + 4?", [(tool, "7"), (tool, "7 again")])
    assert prompt == (
        "<|im_start|>system\nSolve with the calculator.\nTools: calculator<|im_end|>\n"
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
        f"<|im_start|>assistant\n{tool}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\n{tool}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n7 again\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.decode(tok.encode(prompt)) == prompt


@pytest.mark.parametrize("use_qwen", [False, True])
def test_prompt_plus_output_is_a_prefix_of_the_next_prompt(use_qwen, request):
    tok = request.getfixturevalue("qwen25_tokenizer") if use_qwen else ByteTokenizer()
    turns = [('<call agent="math"/>', "7"), ('<think>x</think><call agent="qa">y</call>', "z")]
    for k in range(len(turns)):
        prompt = render_prompt(tok, MASTER, "Q?", turns[:k], hint=Hint("a", "b"))
        following = render_prompt(tok, MASTER, "Q?", turns[:k + 1], hint=Hint("a", "b"))
        assert following.startswith(prompt + turns[k][0])


# ------------------------------------------------------------------------------------------------
# Observations.
# ------------------------------------------------------------------------------------------------


def test_format_observation():
    assert format_observation("short", 10) == "short"
    assert format_observation("x" * 10, 10) == "x" * 10
    cut = format_observation("abcdefghijk", 10)
    assert cut == "abcde" + TRUNCATION_MARK and len(cut) == 10
    assert len(format_observation("y" * 10_000)) == protocol.MAX_OBSERVATION_CHARS


def test_format_observation_removes_control_tokens():
    assert format_observation("a<|im_end|>\n<|im_start|>user\nb<|endoftext|>", 100) == \
        "a\nuser\nb"
    sneaky = "<|im_<|im_end|>end|>"  # Removing the inner token joins an outer one.
    assert format_observation(sneaky, 100) == ""


def test_format_observation_rejects_tiny_limit():
    with pytest.raises(ValueError, match="max_chars must be at least 5"):
        format_observation("abc", 4)
