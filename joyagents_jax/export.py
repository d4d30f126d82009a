"""`joyagents export --workdir DIR --out DIR`: every agent as a Hugging Face folder, plus memory.

Writes `<out>/<agent>/` (config.json, generation_config.json, safetensors) that
`transformers.AutoModelForCausalLM.from_pretrained` (or vLLM) loads, with the run's tokenizer
files when it used an HF tokenizer, and `<out>/memory.jsonl` with the decoded memory entries.
A LoRA agent's folder holds its adapters merged into the base; `<out>/lora/<agent>/` holds the
adapters alone as a PEFT folder, over the group's base `<out>/lora/base_<group>/`. A finished
run with `grpo.select_every` exports its chosen policies (`export.json` names their step).

Everything is written into `<out>.partial-<id>/` first and renamed to `<out>` when complete (a
previous export there is replaced), so `<out>` never holds half an export or two mixed ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid

import jax

from joyagents_jax import distributed, evaluate, tokenizers
from joyagents_jax.models import hf_io, lora
from joyagents_jax.rl import memory as memory_lib

EXPORT = "export.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "added_tokens.json")


def export(workdir: str, out: str, step: int | None = None, dtype: str | None = None) -> list[str]:
    """Exports the run's agents; returns the folders written. In a multi-process job every
    process gathers the weights (a collective) and process 0 writes."""
    out = os.path.normpath(out)
    _check_out(out)
    exp, run = evaluate.load_run(workdir, step)
    policies_step, run = exp.chosen_step(run), exp.chosen(run)
    primary = distributed.is_primary()
    staging = f"{out}.partial-{uuid.uuid4().hex[:8]}"
    if primary:
        os.makedirs(staging)
    generation = {"eos_token_id": list(exp.tokenizer.stop_ids),
                  "pad_token_id": exp.tokenizer.pad_id}

    def save(folder, model, params):
        hf_io.save_params(os.path.join(staging, folder), model, params, dtype=dtype,
                          generation_config=generation)
        _tokenizer_files(exp.config.tokenizer, exp.tokenizer, os.path.join(staging, folder))

    written = []
    bases = {name: distributed.to_host(g.base) for name, g in run.train.groups.items()
             if g.lora is not None}
    for name, base in bases.items():  # a LoRA group's base, once: the adapters' base
        if primary:
            save(_lora_base_folder(name), run.train.groups[name].model, base)
        written.append(_lora_base_folder(name))
    for agent, (group, index) in exp.slots.items():
        g = run.train.groups[group]
        params = distributed.to_host(jax.tree.map(lambda x: x[index], g.params))
        if primary and g.lora is None:
            save(agent, g.model, params)
        elif primary:  # merged for transformers and vLLM, and the adapter for peft
            save(agent, g.model, lora.merge(bases[group], params, g.lora.scale))
            hf_io.save_peft_adapter(os.path.join(staging, "lora", agent), params, g.lora,
                                    os.path.join(out, _lora_base_folder(group)), dtype=dtype)
        written.append(agent)
    tables = distributed.to_host(run.memory)
    if primary and tables:
        memory_lib.dump(memory_lib.agent_tables(tables, exp.slots), exp.tokenizer,
                        os.path.join(staging, "memory.jsonl"))
    if primary:
        with open(os.path.join(staging, EXPORT), "w") as f:
            json.dump({"workdir": os.path.abspath(workdir), "step": int(run.step),
                       "policies_step": policies_step,
                       "agents": sorted(exp.slots)}, f, indent=2)
        _publish(staging, out)
    return [os.path.join(out, folder) for folder in written]


def _check_out(out: str) -> None:
    """`out` is new, empty or a previous export (which is replaced); anything else is refused
    before any work."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; pass a folder (it is created).")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, EXPORT)):
        raise ValueError(f"--out {out} holds files that are not an export (no {EXPORT}); pass a "
                         f"new or empty folder, or move those files away.")


def _publish(staging: str, out: str) -> None:
    """Renames the finished `staging` to `out`; an export already there is replaced (moved aside
    first, so a crash in between leaves both whole)."""
    old = f"{staging}.replaced"
    if os.path.exists(out):
        os.rename(out, old)
    os.rename(staging, out)
    if os.path.exists(old):
        shutil.rmtree(old)


def _lora_base_folder(group: str) -> str:
    return os.path.join("lora", f"base_{group}")


def _tokenizer_files(spec: str, tokenizer: tokenizers.Tokenizer, folder: str) -> None:
    """Copies an HF tokenizer's files, or writes an embedded one as a folder transformers loads."""
    if spec == "bytes":
        tokenizers.save_byte_tokenizer(folder)
        return
    if isinstance(tokenizer, tokenizers.BPETokenizer):
        tokenizer.save_hf(folder)
        return
    for name in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(spec, name)):
            shutil.copy(os.path.join(spec, name), folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="joyagents export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: as trained)")
    args = parser.parse_args(argv)
    distributed.initialize()
    try:
        for folder in export(args.workdir, args.out, args.step, args.dtype):
            if distributed.is_primary():
                print(f"wrote {folder}")
    except ValueError as e:
        print(f"joyagents export: {e}", file=sys.stderr)
        return 2
    return 0
