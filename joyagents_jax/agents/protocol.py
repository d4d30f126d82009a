"""The agent protocol, text only: what an agent writes (one action) and what it reads (a prompt).

A node is one generation by one agent; it ends at the closing tag of its action:

    [<think>free text</think>] ACTION
    master:    <call agent="NAME">sub-query</call> | <call agent="NAME"/> | <answer>TEXT</answer>
    sub-agent: <tool name="NAME">{json object}</tool> | <answer>TEXT</answer>

`parse_action` checks syntax only (an unknown agent or tool name is the engine's business: it
becomes an observation) and returns a typed `ParseError` instead of raising, so malformed model
output never crashes an episode. `render_action` is its inverse and writes gold demonstrations.

Results of tools and sub-agents come back as observations, never generated. The design's
`<observation>TEXT</observation>` is realized as an observation *turn* of the chat, so no bytes
go to extra tags: role "observation" in the byte tokenizer's ChatML, role "tool" in Qwen2.5's
chat template (which renders it as a user turn wrapping the text in <tool_response>).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, get_args

from joyagents_jax.tokenizers import ENDOFTEXT, IM_END, IM_START, Tokenizer

Role = Literal["master", "sub"]
MASTER = "master"  # The agent with this name routes; every other agent is a sub-agent.

# The sampler stops on strings. The self-closing call ends with `"/>`: the quote makes it
# specific (a name cannot hold a quote), and it stops only the master. A sub-agent's JSON args
# may well contain "/>" (a URL, an HTML value), so sub-agents never stop on it. A master's think
# or sub-query holding `"/>` literally would be cut short; `render_action` refuses such text.
_ROLE_STOPS: dict[str, tuple[str, ...]] = {
    "master": ("</call>", '"/>', "</answer>"),
    "sub": ("</tool>", "</answer>"),
}
STOP_STRINGS = ("</call>", "</tool>", "</answer>", '"/>')  # All roles' stop strings.

MAX_OBSERVATION_CHARS = 256  # Default cap on an observation: every byte costs compute on CPU.
TRUNCATION_MARK = "[...]"


def stop_strings(role: Role) -> tuple[str, ...]:
    """The strings that end a node of `role` (pass them to the sampler)."""
    _check_role(role)
    return _ROLE_STOPS[role]


def _check_role(role: str) -> None:
    if role not in _ROLE_STOPS:
        raise ValueError(f"Unknown role {role!r}; expected one of {sorted(_ROLE_STOPS)}.")


# ------------------------------------------------------------------------------------------------
# Actions and parse failures.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    """Master: hand `query` to sub-agent `agent`; `query=None` forwards the user query unchanged."""
    agent: str
    query: str | None = None
    think: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """Sub-agent: run tool `name` with keyword arguments `args` (a JSON object)."""
    name: str
    args: dict[str, Any]
    think: str | None = None


@dataclasses.dataclass(frozen=True)
class Answer:
    """Either role: the final answer of this agent's turn."""
    text: str
    think: str | None = None


Action = Call | ToolCall | Answer

ParseErrorKind = Literal[
    "empty",             # Nothing but whitespace or end-of-turn tokens.
    "no_action",         # No action tag (plain text, or only a think block).
    "leading_text",      # Text before the action.
    "misplaced_think",   # A <think> block that is not the first element.
    "unknown_tag",       # A tag that is not part of the protocol.
    "wrong_role",        # The master wrote <tool>, or a sub-agent wrote <call>.
    "bad_tag",           # A malformed opening tag, e.g. <call> without agent="...".
    "unclosed",          # An opening tag without its closing tag.
    "nested_tag",        # An element inside another of the same name.
    "bad_json",          # Tool arguments that are not JSON.
    "args_not_object",   # Tool arguments that are JSON but not an object.
    "trailing_text",     # Text after the action's closing tag.
    "multiple_actions",  # A second action after the first.
]
PARSE_ERROR_KINDS: tuple[str, ...] = get_args(ParseErrorKind)


@dataclasses.dataclass(frozen=True)
class ParseError:
    """Why a node's text is not a well-formed action (a value, never raised)."""
    kind: ParseErrorKind
    detail: str


# ------------------------------------------------------------------------------------------------
# Parsing and rendering.
# ------------------------------------------------------------------------------------------------

_TAG = re.compile(r"</?[A-Za-z][\w-]*")
_ELEMENT_START = re.compile(r"<(?:call|tool|answer|think)\b")
_ACTION_START = re.compile(r"<(?:call|tool|answer)\b")
_NAME = r'[^\s"<>]+'
_OPENERS = {
    "think": re.compile(r"<think>"),
    "answer": re.compile(r"<answer>"),
    "call": re.compile(rf'<call agent="(?P<name>{_NAME})"\s*(?P<selfclose>/?)>'),
    "tool": re.compile(rf'<tool name="(?P<name>{_NAME})"\s*>'),
}
_NESTED = {tag: re.compile(rf"<{tag}\b") for tag in _OPENERS}
_ROLE_TAGS = {"master": ("call", "answer"), "sub": ("tool", "answer")}
_END_TOKENS = (IM_END, ENDOFTEXT)
_CONTROL_TOKENS = (IM_START, IM_END, ENDOFTEXT)


def parse_action(text: str, role: Role) -> Action | ParseError:
    """The action that `text` (one node's output) spells for an agent of `role`, or why not.

    Surrounding whitespace and end-of-turn tokens after the action are ignored; contents are kept
    verbatim. Never raises for any string `text` (only for an unknown `role`).
    """
    _check_role(role)
    text = _strip_end(text).lstrip()
    if not text:
        return ParseError("empty", "the node wrote nothing")
    think = None
    if _tag_name(text) == "think":
        parsed = _element(text, "think")
        if isinstance(parsed, ParseError):
            return parsed
        _, think, end = parsed
        text = text[end:].lstrip()
        if not text:
            return ParseError("no_action", "a <think> block without an action")
    tag = _tag_name(text)
    if tag is None:
        kind = "leading_text" if _ELEMENT_START.search(text) else "no_action"
        return ParseError(kind, _snippet(text))
    if tag == "think":
        return ParseError("misplaced_think", "<think> may only come first, once")
    if tag not in ("call", "tool", "answer"):
        return ParseError("unknown_tag", f"<{tag}>")
    if tag not in _ROLE_TAGS[role]:
        return ParseError("wrong_role", f"a {role} agent cannot write <{tag}>")
    parsed = _element(text, tag)
    if isinstance(parsed, ParseError):
        return parsed
    opener, content, end = parsed
    if tag == "answer":
        action = Answer(content, think)
    elif tag == "call":
        action = Call(opener["name"], content, think)
    else:
        action = _tool_call(opener["name"], content, think)
    rest = text[end:].strip()
    if rest and not isinstance(action, ParseError):
        kind = "multiple_actions" if _ACTION_START.search(rest) else "trailing_text"
        return ParseError(kind, _snippet(rest))
    return action


def render_action(action: Action) -> str:
    """The text of `action`: the inverse of `parse_action`, and a text the sampler can finish.

    Raises ValueError for contents that cannot round-trip (a closing tag, a nested tag, or a stop
    string inside a content; a name with whitespace, quotes or angle brackets). Answers are
    checked for both roles.
    """
    head = "" if action.think is None else f"<think>{action.think}</think>"
    if isinstance(action, Answer):
        body, roles = f"<answer>{action.text}</answer>", ("master", "sub")
    elif isinstance(action, Call):
        rest = "/>" if action.query is None else f">{action.query}</call>"
        body, roles = f'<call agent="{action.agent}"{rest}', ("master",)
    else:
        body, roles = f'<tool name="{action.name}">{_dump_args(action.args)}</tool>', ("sub",)
    text = head + body
    for role in roles:
        if parse_action(text, role) != action or _first_stop_end(text, role) != len(text):
            raise ValueError(f"{action!r} cannot be rendered for a {role} agent: a name or "
                             "content holds a tag, a stop string or a forbidden character.")
    return text


def _strip_end(text: str) -> str:
    """`text` without trailing whitespace and end-of-turn tokens (linear time)."""
    end = len(text)
    while True:
        while end and text[end - 1].isspace():
            end -= 1
        token = next((t for t in _END_TOKENS if text.endswith(t, 0, end)), None)
        if token is None:
            return text[:end]
        end -= len(token)


def _tag_name(text: str) -> str | None:
    """The name of the tag `text` starts with ("/x" for a closing tag), or None."""
    match = _TAG.match(text)
    return None if match is None else match.group()[1:]


def _element(text: str, tag: str) -> tuple[re.Match, str | None, int] | ParseError:
    """(opening-tag match, content or None if self-closing, end) of the element starting `text`."""
    opener = _OPENERS[tag].match(text)
    if opener is None:
        return ParseError("bad_tag", f"malformed <{tag}> tag: {_snippet(text)}")
    if opener.groupdict().get("selfclose"):
        return opener, None, opener.end()
    close = f"</{tag}>"
    end = text.find(close, opener.end())
    if end < 0:
        return ParseError("unclosed", f"<{tag}> without {close}")
    content = text[opener.end():end]
    if _NESTED[tag].search(content):
        return ParseError("nested_tag", f"<{tag}> inside <{tag}>")
    return opener, content, end + len(close)


def _tool_call(name: str, content: str, think: str | None) -> ToolCall | ParseError:
    try:
        args = json.loads(content)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError.
        return ParseError("bad_json", f"tool {name!r}: {type(e).__name__}: {str(e)[:80]}")
    if not isinstance(args, dict):
        return ParseError("args_not_object", f"tool {name!r} got a JSON {type(args).__name__}")
    return ToolCall(name, args, think)


def _dump_args(args: dict[str, Any]) -> str:
    """Compact JSON (bytes cost compute); "</" written as "<\\/" so no closing tag can appear."""
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False).replace("</", "<\\/")


def _first_stop_end(text: str, role: Role) -> int:
    """Where the sampler would cut `text`: the end of the earliest stop string in it."""
    ends = [text.find(s) + len(s) for s in stop_strings(role) if s in text]
    return min(ends, default=len(text))


def _snippet(text: str, limit: int = 40) -> str:
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


# ------------------------------------------------------------------------------------------------
# Prompts.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AgentSpec:
    """What an agent's prompt says about it (config-driven; keep it short).

    `tools`: the tools a sub-agent may use, or, for the master, the agents it may call.
    """
    name: str
    role_prompt: str
    tools: tuple[str, ...] = ()

    @property
    def role(self) -> Role:
        return "master" if self.name == MASTER else "sub"


class Hint(NamedTuple):
    """A memory entry shown as an experience hint: a past request and its rewarded response."""
    request: str
    response: str


Turn = tuple[str, str]  # (a node's output, verbatim; the observation that followed it)
Message = dict[str, str]


def system_prompt(spec: AgentSpec, hint: Hint | None = None) -> str:
    """Role prompt, then the callable agents or tools, then the memory hint (if any)."""
    lines = [spec.role_prompt]
    if spec.tools:
        lines.append(f"{'Agents' if spec.role == MASTER else 'Tools'}: {', '.join(spec.tools)}")
    if hint is not None:
        lines.append(f"Similar past request: {hint.request}\nGood response: {hint.response}")
    return "\n".join(line for line in lines if line)


def render_messages(spec: AgentSpec, query: str, turns: Sequence[Turn] = (),
                    hint: Hint | None = None, *,
                    observation_role: str = "observation") -> list[Message]:
    """The chat of one node: system, the (sub-)query as user, then (output, observation) turns."""
    messages = [{"role": "system", "content": system_prompt(spec, hint)},
                {"role": "user", "content": query}]
    for output, observation in turns:
        messages += [{"role": "assistant", "content": output},
                     {"role": observation_role, "content": observation}]
    return messages


def observation_role(tokenizer: Tokenizer) -> str:
    """"observation" for the embedded tokenizers' ChatML; "tool" for HF chat templates (Qwen2.5)."""
    return getattr(tokenizer, "observation_role", "tool")


def render_prompt(tokenizer: Tokenizer, spec: AgentSpec, query: str,
                  turns: Sequence[Turn] = (), hint: Hint | None = None) -> str:
    """A node's prompt (its whole training context), ending where the assistant's output starts.

    With either tokenizer, prompt(turns[:k]) + turns[k][0] is a prefix of prompt(turns[:k + 1]).
    """
    messages = render_messages(spec, query, turns, hint,
                               observation_role=observation_role(tokenizer))
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def format_observation(text: str, max_chars: int = MAX_OBSERVATION_CHARS) -> str:
    """`text` as an observation: at most `max_chars` characters, cut with TRUNCATION_MARK.

    ChatML control strings are removed, so a tool result or a sub-agent's answer can never
    end or open a turn of the prompt.
    """
    if max_chars < len(TRUNCATION_MARK):
        raise ValueError(f"max_chars must be at least {len(TRUNCATION_MARK)}, got {max_chars}.")
    if len(text) > max_chars:
        text = text[:max_chars - len(TRUNCATION_MARK)] + TRUNCATION_MARK
    while any(token in text for token in _CONTROL_TOKENS):  # Removal can join a new one.
        for token in _CONTROL_TOKENS:
            text = text.replace(token, "")
    return text
