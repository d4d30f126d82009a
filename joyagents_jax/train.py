"""`joyagents train`: SFT warm start, then JoyAgents-R1 GRPO, with exact resume.

    joyagents train --workdir runs/tiny                       # the embedded default
    joyagents train --config experiments/configs/qwen2p5_3b.py --workdir runs/3b \\
        --config.groups.all.checkpoint=/ckpt/Qwen2.5-3B-Instruct

The loop holds one `RunState` (train state, memory tables, step) and replaces it each step
with `Experiment.sft_iteration` or `Experiment.grpo_iteration` (rollout -> GRPO update -> memory
update). Evaluation every `eval.sft_every` / `eval.grpo_every` steps of each phase and at each
phase's end; a checkpoint of the whole run state every `checkpoint.every` steps, at the end of
each phase, and on SIGTERM, SIGINT or SIGHUP (preemption, Ctrl-C, a closed terminal).
Restarting on the same workdir resumes from the latest readable checkpoint, and since every
random draw derives from (seed, step), the resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys

import jax
import ml_collections

from joyagents_jax import checkpoint, config_checks, distributed, experiment, metrics, plots
from joyagents_jax import preemption
from joyagents_jax import workdir as workdir_lib
from joyagents_jax.run_state import RunState

log = logging.getLogger("joyagents")
BEST = "eval/test/accuracy"  # the checkpoint kept as best, besides the last N


class TrainingStopped(RuntimeError):
    """Updates kept failing (non-finite); the last checkpoint holds the last finite state."""


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Runs (or resumes) the whole pipeline; returns the final evaluation's metrics.

    The config and the workdir are checked before anything is built or written; a workdir whose
    run already reached its last step is left as it is, and one that another run holds is
    refused (`workdir.held`).
    """
    config_checks.validate(config)
    with workdir_lib.held(workdir, enabled=jax.process_index() == 0):
        return _train(config, workdir)


def _train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    distributed.primary_first("workdir_check", lambda: workdir_lib.check(config, workdir))
    final = workdir_lib.finished(config, workdir)
    if final is not None:
        report(final, workdir, already=True)
        return final
    primary = jax.process_index() == 0
    hangup_log = os.path.join(workdir, workdir_lib.HANGUP_LOG) if primary else os.devnull
    exp = experiment.Experiment(config, workdir)
    distributed.write_run_info(workdir, exp.mesh)
    total = config.sft.steps + config.grpo.steps

    with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                                 best_metric=BEST) as ckpt, \
            preemption.Guard(hangup_log=hangup_log) as guard:
        run = restore(exp, ckpt)
        if primary:  # only now: a rejected resume leaves the saved config as it was
            workdir_lib.write_config(config, workdir)
        with metrics.MetricsWriter(workdir, enabled=primary) as writer:
            writer.truncate_after(int(run.step))
            run, last_eval = _loop(exp, ckpt, guard, writer, run)
    if int(run.step) < total:  # preempted: the checkpoint is saved, a rerun resumes
        return last_eval
    if not last_eval:  # resumed at the last step (a stop between its save and the report)
        last_eval = final_evaluation(exp, run)
    if primary:
        plots.plot_workdir(workdir)
        tmp = os.path.join(workdir, workdir_lib.FINAL_EVAL + ".tmp")
        with open(tmp, "w") as f:
            json.dump(last_eval, f, indent=2)
        os.replace(tmp, os.path.join(workdir, workdir_lib.FINAL_EVAL))
        report(last_eval, workdir)
    return last_eval


def _loop(exp, ckpt, guard, writer, run: RunState) -> tuple[RunState, dict[str, float]]:
    """The steps from `run` to the end or a preemption; returns the last run state and the
    last evaluation's metrics."""
    config = exp.config
    sft_steps, total = config.sft.steps, config.sft.steps + config.grpo.steps
    progress = metrics.Progress(total, "train", initial=int(run.step), enabled=writer.enabled)
    last_eval: dict[str, float] = {}
    skipped_in_a_row = 0
    while int(run.step) < total:
        if exp.lora_pending(run):  # the shared SFT phase is over: adapters over a frozen base
            run = exp.to_lora(run)
            exp.save_bases(run)
        if run.phase == "sft" and int(run.step) >= sft_steps:
            run = exp.start_grpo(run)
        if run.phase == "sft":
            run, m = exp.sft_iteration(run)
            postfix = {"loss": m["sft/loss"]}
        else:
            run, m = exp.grpo_iteration(run)
            postfix = {"reward": m["grpo/reward"], "acc": m["grpo/accuracy"],
                       "tok/s": m["rollout/tokens_per_second"]}
        step, phase = int(run.step), run.phase
        if exp.selection_due(run):
            run, chosen = exp.select(run)
            m.update(chosen)
        boundary = step in (sft_steps, total)
        if step == total:
            last_eval = final_evaluation(exp, run)
            m.update(last_eval)
        elif _evaluates(step, config) or boundary:
            last_eval = evaluate_all(exp, run, policy_alone=phase == "grpo")
            m.update(last_eval)
        writer.write(step, m, phase=phase)
        progress.update(1, phase=phase, **postfix)
        skipped_in_a_row = skipped_in_a_row + 1 if m.get(f"{phase}/skipped") else 0
        if skipped_in_a_row >= config.max_skipped_steps:
            progress.close()
            raise TrainingStopped(
                f"steps {step - skipped_in_a_row + 1}-{step} ({phase}) were all skipped: the "
                f"loss, the gradients or the updated parameters were not finite, so no update "
                f"was kept. Checkpoints hold only finite states ({_latest(ckpt)}). Lower "
                f"config.{phase}.learning_rate (or raise config.max_skipped_steps), then rerun "
                f"to resume.")
        stop = guard.stop_agreed()
        if _every(step, config.checkpoint.every) or boundary or stop:
            meta = {**run.metadata(), **({BEST: m[BEST]} if BEST in m else {})}
            ckpt.save(step, run.without_bases(), meta, force=True)
        if stop:
            log.warning("Preempted at step %d: checkpoint saved, exiting.", step)
            break
    progress.close()
    return run, last_eval


def _latest(ckpt: checkpoint.Checkpointer) -> str:
    step = ckpt.latest_step()
    return "none saved yet" if step is None else f"latest: step {step}"


def _every(step: int, every: int) -> bool:
    """True every `every` steps; never when every is 0 (phase ends only)."""
    return bool(every) and step % every == 0


def _evaluates(step: int, config) -> bool:
    """Periodic evaluation after `step` (counted from 1): every `eval.sft_every` SFT steps and
    every `eval.grpo_every` GRPO steps, counted within the phase."""
    if step <= config.sft.steps:
        return _every(step, config.eval.sft_every)
    return _every(step - config.sft.steps, config.eval.grpo_every)


def report(final: dict[str, float], workdir: str, already: bool = False) -> None:
    """Prints the held-out accuracies of the run's end (stdout: the run's answer)."""
    head = (f"{workdir} is already complete; nothing was changed." if already
            else f"Finished: {workdir}")
    rows = [f"  {k.split('/')[1]}: {v:.3f}" + (
                f" (policies alone, without the memory: {final[alone]:.3f})"
                if (alone := k.replace("eval/", "eval_no_memory/")) in final else "")
            for k, v in sorted(final.items()) if k.startswith("eval/") and k.endswith("/accuracy")]
    chosen = ([f"  The policies of GRPO step {int(final['select/chosen_step'])}, the best on the "
               f"selection slice (config.grpo.select_every, select_split)."]
              if "select/chosen_step" in final else [])
    print("\n".join([head, "Held-out accuracy at the end (greedy; with the memory when it is "
                     "on):", *rows, *chosen,
                     f"Per domain: {os.path.join(workdir, 'final_eval.json')}"]))


def evaluate_all(exp: experiment.Experiment, run: RunState, *,
                 policy_alone: bool = False) -> dict[str, float]:
    """eval/<split>/... for every split (with the memory when the run has one); with
    `policy_alone`, also eval_no_memory/<split>/...: what the trained policies do by themselves."""
    out = {}
    for split in exp.config.eval.splits:
        out.update(exp.evaluate(run, split, exp.config.eval.examples))
        if policy_alone and run.memory:
            alone = exp.evaluate(run, split, exp.config.eval.examples, use_memory=False)
            out.update({f"eval_no_memory/{k.removeprefix('eval/')}": v for k, v in alone.items()})
    return out


def final_evaluation(exp: experiment.Experiment, run: RunState) -> dict[str, float]:
    """`evaluate_all` of the run's result (`Experiment.chosen`), with the GRPO step its
    policies come from when selection chose them."""
    out = evaluate_all(exp, exp.chosen(run), policy_alone=run.phase == "grpo")
    if run.selects:
        out["select/chosen_step"] = float(int(run.selected.step) - exp.config.sft.steps)
    return out


def restore(exp: experiment.Experiment, ckpt: checkpoint.Checkpointer) -> RunState:
    """The run state of the latest readable checkpoint, or a fresh start.

    The checkpoint's phase decides the state's structure (SFT or GRPO optimizer, memory), so
    the abstract tree is built from each candidate checkpoint's own metadata.
    """
    fresh = exp.init_run()
    try:
        found = ckpt.restore_latest_valid(lambda meta: abstract_run(exp, fresh, meta))
    except checkpoint.CheckpointMismatchError:
        raise
    except RuntimeError as e:  # every step unreadable: never restart silently
        raise workdir_lib.unreadable(exp.workdir) from e
    if found is None and workdir_lib.corrupt_steps(exp.workdir):  # set aside when opened
        raise workdir_lib.unreadable(exp.workdir)
    if found is None:
        return fresh
    run, meta = found
    log.info("Resumed from step %d (%s).", meta["step"], meta["phase"])
    return exp.with_selection(exp.attach_bases(run, fresh), bool(exp.config.grpo.select_every))


def abstract_run(exp: experiment.Experiment, fresh: RunState, meta: dict) -> RunState:
    """A run state shaped like the checkpoint with metadata `meta` (its phase and step): GRPO's
    optimizer and memory tables, the chosen iterate where it saved one, LoRA adapters once they
    have started, no LoRA base."""
    run = exp.to_lora(fresh) if exp.lora_from_step(meta["step"]) else fresh
    run = exp.start_grpo(run) if meta["phase"] == "grpo" else run
    return exp.with_selection(run, meta.get("selection", False)).without_bases()


USAGE = """usage: joyagents train [--config FILE[:ARG]] [--config.KEY=VALUE ...] [--workdir DIR]

SFT warm start, then JoyAgents-R1 GRPO, with exact resume. --config is a get_config() file
(default: the embedded joyagents_jax/config.py); --config.KEY=VALUE overrides one field, e.g.
--config.grpo.steps=60 --config.memory.enabled=false. --workdir (default workdir/default) holds
checkpoints, metrics.jsonl, tb/, plots/ and final_eval.json; rerunning it resumes."""


def parse_config_flags(prog: str, argv: list[str], usage: str):
    """absl flags --config (a config file) and --workdir: the parsed FlagValues, or an exit
    status after printing usage (--help: 0) or one line naming the bad argument (2)."""
    from absl import flags
    from ml_collections import config_flags

    from joyagents_jax import config as config_lib

    if any(a in ("-h", "--help", "-help") for a in argv):
        print(usage)
        return 0
    values = flags.FlagValues()
    try:  # config_flags reads the --config.KEY overrides already while defining the flag (from
        # `argv`, not sys.argv, so an in-process `main(argv)` gets its own overrides)
        config_flags.DEFINE_config_file("config", config_lib.__file__,
                                        "Config file (get_config).", flag_values=values,
                                        lock_config=False, sys_argv=[prog] + list(argv))
        flags.DEFINE_string("workdir", "workdir/default", "Where checkpoints, logs, plots go.",
                            flag_values=values)
        values([prog] + list(argv))
        values.config.keys()  # loads the file and applies the overrides now
    except Exception as e:  # noqa: BLE001 - a bad file, arg or key: one line, no traceback
        print(f"{prog}: {_flag_problem(argv, e)}", file=sys.stderr)
        return 2
    return values


def _flag_problem(argv: list[str], error: Exception) -> str:
    """One line for a failed --config: the argument it came from and the error's own words."""
    lines = [ln.strip() for ln in str(error).replace("\\n", "\n").splitlines() if ln.strip()]
    raised = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception): ", ln)]
    text = " ".join((raised[-1].split(": ", 1)[1] if raised else " ".join(lines)).split())
    if "Failed loading config file" in text:
        errno = [ln for ln in lines if ln.startswith("[Errno")]
        path = next((a for a in argv if a.startswith("--config=")), "--config")
        return f"{path}: cannot load the config file ({errno[-1] if errno else text})."
    if isinstance(error, (AttributeError, KeyError)):
        key = re.search(r"\w+", text).group()
        bad = [a for a in argv if a.startswith("--config.") and key in a.split("=")[0]]
        hint = text[text.index("Did you mean"):].rstrip("'\"") if "Did you mean" in text else ""
        return (f"{bad[0] if bad else 'a --config.KEY override'}: unknown config key {key!r}. "
                f"{hint}").strip()
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point: --config (a get_config() file, default: the embedded one) --workdir."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags_ = parse_config_flags("joyagents train", argv, USAGE)
    if isinstance(flags_, int):
        return flags_
    distributed.initialize()  # a multi-process launch joins its peers; one process: nothing
    try:
        train(flags_.config, flags_.workdir)
    except ValueError as e:  # bad config, workdir or input: a clear message, no traceback
        print(f"joyagents train: {e}", file=sys.stderr)
        return 2
    except (TrainingStopped, checkpoint.SaveError) as e:
        print(f"joyagents train: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
