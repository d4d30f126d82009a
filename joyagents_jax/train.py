"""`joyagents train`: SFT warm start, then JoyAgents-R1 GRPO, with exact resume.

    joyagents train --workdir runs/tiny                       # the embedded default
    joyagents train --config experiments/configs/qwen2p5_3b.py --workdir runs/3b \\
        --config.groups.all.checkpoint=/ckpt/Qwen2.5-3B-Instruct

Each GRPO step: queries -> memory lookup -> rollout -> train step -> memory update -> metrics.
Evaluation every `eval.every` steps; a checkpoint every `checkpoint.every` steps, at the end of
each phase, and on SIGTERM (preemption). Restarting on the same workdir resumes from the latest
readable checkpoint: params, optimizer, reference, memory, step and phase, and since every
random draw derives from (seed, step), the resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import jax
import ml_collections

from joyagents_jax import checkpoint, experiment, metrics, plots

log = logging.getLogger("joyagents")
BEST = "eval/test/accuracy"  # the checkpoint kept as best, besides the last N


def _checkpoint_tree(state, memory) -> dict:
    return {"state": state, "memory": memory.tables if memory is not None else {}}


def make_memory(exp: experiment.Experiment, state):
    """The memory hook for a GRPO phase (None when the config turns the memory off)."""
    if not exp.config.memory.enabled:
        return None
    from joyagents_jax import memory as memory_lib

    return memory_lib.from_experiment(exp, state)


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Runs (or resumes) the whole pipeline; returns the last evaluation's metrics."""
    os.makedirs(workdir, exist_ok=True)
    primary = jax.process_index() == 0
    exp = experiment.Experiment(config, workdir)
    sft_steps, total = config.sft.steps, config.sft.steps + config.grpo.steps
    if primary:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))

    fresh = exp.init_state()
    with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                                 best_metric=BEST) as ckpt, \
            metrics.MetricsWriter(workdir, enabled=primary) as writer, \
            checkpoint.PreemptionGuard() as guard:
        state, memory, step, phase = restore(exp, ckpt, fresh)
        writer.truncate_after(step)
        progress = metrics.Progress(total, "train", initial=step, enabled=primary)
        last_eval: dict[str, float] = {}
        while step < total:
            if phase == "sft" and step >= sft_steps:
                state, phase = exp.start_grpo(state), "grpo"
                memory = make_memory(exp, state)
            if phase == "sft":
                state, m = exp.sft_step(state, step)
                postfix = {"loss": m["sft/loss"]}
            else:
                state, m, result = exp.grpo_step(state, step - sft_steps, memory)
                if memory is not None:
                    memory_start = time.perf_counter()
                    m.update({f"memory/{k}": v
                              for k, v in memory.update_from_rollout(result, step).items()})
                    m["time/memory_update_seconds"] = time.perf_counter() - memory_start
                postfix = {"reward": m["grpo/reward"], "acc": m["grpo/accuracy"],
                           "tok/s": m["rollout/tokens_per_second"]}
            step += 1
            boundary = step in (sft_steps, total)
            if step % config.eval.every == 0 or boundary:
                last_eval = evaluate_all(exp, state, memory)
                m.update(last_eval)
            writer.write(step, m, phase=phase)
            progress.update(1, phase=phase, **postfix)
            stop = guard.stop_agreed()
            if step % config.checkpoint.every == 0 or boundary or stop:
                meta = {"step": step, "phase": phase, **({BEST: m[BEST]} if BEST in m else {})}
                ckpt.save(step, _checkpoint_tree(state, memory), meta, force=True)
            if stop:
                log.warning("Preempted at step %d: checkpoint saved, exiting.", step)
                break
        progress.close()
    if primary and step >= total:
        plots.plot_workdir(workdir)
        with open(os.path.join(workdir, "final_eval.json"), "w") as f:
            json.dump(last_eval, f, indent=2)
    return last_eval


def evaluate_all(exp: experiment.Experiment, state, memory) -> dict[str, float]:
    out = {}
    for split in exp.config.eval.splits:
        out.update(exp.evaluate(state, split, exp.config.eval.examples, memory))
    return out


def restore(exp: experiment.Experiment, ckpt: checkpoint.Checkpointer, fresh):
    """(state, memory, step, phase) from the latest readable checkpoint, or the fresh start.

    The checkpoint's phase decides the state's structure (SFT or GRPO optimizer, memory), so
    the abstract tree is built from each candidate checkpoint's own metadata.
    """
    found = ckpt.restore_latest_valid(lambda meta: abstract_tree(exp, fresh, meta["phase"]))
    if found is None:
        return fresh, None, 0, "sft"
    tree, meta = found
    log.info("Resumed from step %d (%s).", meta["step"], meta["phase"])
    state, memory = from_tree(exp, tree, meta["phase"])
    return state, memory, int(meta["step"]), meta["phase"]


def abstract_tree(exp: experiment.Experiment, fresh, phase: str) -> dict:
    """A tree shaped like the checkpoint of `phase` (GRPO: new optimizer, memory tables)."""
    state = exp.start_grpo(fresh) if phase == "grpo" else fresh
    return _checkpoint_tree(state, make_memory(exp, state) if phase == "grpo" else None)


def from_tree(exp: experiment.Experiment, tree: dict, phase: str):
    """(state, memory hook) of a restored tree; the hook embeds with the restored reference."""
    memory = make_memory(exp, tree["state"]) if phase == "grpo" else None
    if memory is not None:
        memory.tables = tree["memory"]
    return tree["state"], memory


def main(argv: list[str] | None = None) -> int:
    """absl entry point: --config (a get_config() file, default: the embedded one) --workdir."""
    from absl import app, flags
    from ml_collections import config_flags

    from joyagents_jax import config as config_lib

    flags_ = flags.FlagValues()
    config_flags.DEFINE_config_file("config", config_lib.__file__, "Config file (get_config).",
                                    flag_values=flags_, lock_config=False)
    flags.DEFINE_string("workdir", "workdir/default", "Where checkpoints, logs, plots go.",
                        flag_values=flags_)
    argv = ["joyagents train"] + list(sys.argv[1:] if argv is None else argv)
    try:
        flags_(argv)
    except flags.Error as e:
        print(f"joyagents train: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        train(flags_.config, flags_.workdir)
    except ValueError as e:  # bad config or input: a clear message, no traceback
        print(f"joyagents train: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
