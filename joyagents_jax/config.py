"""The embedded default config (`joyagents train` with no --config) and config validation.

Tiny Qwen2-architecture agents with a BPE trained on the built-in assistant suite: SFT warm
start, then JoyAgents-R1 GRPO (node-wise sampling at every agent's nodes, top-K marginal
benefit, memory), sized to learn on a 2-core laptop CPU in minutes. `byte_default()` is the
byte-tokenizer default of sessions 57-63; `experiments/configs/*.py` derive the other setups.
"""

from __future__ import annotations

import ml_collections

from joyagents_jax.agents import protocol

SUB_AGENTS = ("qa", "efc", "gfc", "math")


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    # init_seed: the seed of the agents' random initial weights (and LoRA adapters); -1 uses
    # `seed`. A fixed value starts every run seed from the same weights, as a pretrained
    # checkpoint does, and leaves to `seed` the SFT batches' order and GRPO's draws. With
    # init_seed=0 and sft.demo_seed=0, SFT alone still ended 0.595-0.725 on seeds 0-9 (sd 4.3,
    # against 5.2 with per-seed weights; benchmarks/RESULTS.md, "What the SFT start's spread
    # comes from").
    c.init_seed = -1
    # "suite_bpe": a byte-level BPE trained on the run's demonstrations (2.41x fewer ids than
    # "bytes"; needs the "tiny-bpe" model), so SFT and GRPO steps run over shorter sequences;
    # "bytes" (the default until session 64: `byte_default()`); or a folder with an HF
    # tokenizer (e.g. a Qwen2.5 checkpoint).
    c.tokenizer = "suite_bpe"
    c.dataset = "assistant_suite"  # or "gsm8k": local files in gsm8k_dir (agents master[, math])
    c.suite = "cpu"  # assistant suite config (assistant_suite.CONFIGS)
    c.gsm8k_dir = ""  # train.jsonl and test.jsonl of GSM8K (github.com/openai/grade-school-math)
    c.data_dir = ""  # where the suite is built; default: <workdir>/data
    c.agents = (protocol.MASTER,) + SUB_AGENTS
    # Agent groups: agents sharing an architecture are stacked and vmapped. model: a preset
    # name (random init) unless checkpoint names an HF folder (weights and shape from there).
    c.groups = ml_collections.ConfigDict({"all": {"agents": c.agents, "model": "tiny-bpe",
                                                  "checkpoint": ""}})
    c.param_dtype = "float32"
    c.dtype = "float32"
    c.remat = False
    c.attention_impl = "xla"  # training/prefill attention: "xla", or "cudnn" flash attention (GPU)
    c.mesh = ""  # e.g. "fsdp=-1" or "data=2,fsdp=4": state and batches sharded; "": one device
    # Longest training sequence (context + output); longer rollouts are dropped. 256: the suite
    # BPE's demonstrations with their repeated calls are at most 214 ids (bytes: 463, max_len 512).
    c.max_len = 256
    c.pad_to_max_len = True  # one GRPO-step shape: compiles once (a CPU compile costs ~30 steps)
    # GRPO rows per agent padded at least to this power of two (0: the power of two of the
    # step's most samples per agent). Micro-batches without a real row are skipped, so the
    # padding costs no run time and the step compiles once for up to this many samples per
    # agent, not once per power of two seen (a few compiles of ~10 s each on 2 cores).
    c.pad_rows_to = 64
    # Agents of a group in one vmapped pass of the SFT step, the GRPO step and the rollouts'
    # decoding; the passes run one after another (0: every agent at once). One per pass bounds
    # activation memory to one agent's and on CPU runs unbatched matmul kernels: the default's
    # SFT step 1.55x and GRPO update ~1.2x faster (the README command 5:59 instead of 7:43).
    # Its SFT differs from the one pass's in the last bits, so a seed ends elsewhere, as on
    # another CPU (benchmarks/RESULTS.md, "One agent per pass").
    c.agents_per_pass = 1
    # Sampler shape buckets: prompts and batches are padded at least to these. decode_phases:
    # sizes the generated tokens' cache grows through while decoding; more read fewer empty
    # slots but compile one more decode loop each. The default's short nodes gain nothing from
    # them and 4 phases added 20 s of compiles to its first 12 GRPO steps (benchmarks/
    # RESULTS.md, "A decode loop that reads fewer slots"); 128-token rollouts of a 30M model
    # ran 1.09x faster with 4.
    # min_prompt_bucket 128: the suite BPE's prompts are about half the byte ones' (bytes: 256).
    c.sampler = ml_collections.ConfigDict(dict(min_prompt_bucket=128, min_batch_bucket=4,
                                               decode_phases=1))

    c.limits = ml_collections.ConfigDict(dict(max_nodes=8, max_tokens_per_node=96,
                                              max_observation_chars=96))

    # The first `shared_steps` SFT steps train one base policy on every agent's demonstrations
    # (agents start equal and take the mean gradient), as real agents share a pretrained base.
    # demo_*: rates of an imperfect demonstrator's detours (agents/demonstrator.py): the master
    # first asks the wrong sub-agent, a sub-agent tries a wrong tool or repeats a call; 0: gold.
    # extra_worlds > 0 (assistant suite only) adds the train traffic of that many other worlds
    # to the demonstrations: entities the policies cannot memorize, only copy (0: the suite's).
    # 600 steps: with the suite BPE, 900 steps nearly solved the train traffic (SFT 0.775 on
    # `test`, train reward 0.944) and GRPO added +0.5 alone; 600 leave the policies where the
    # byte default's 900 left them (0.550 / 0.540 / 0.610 on seeds 0-2; bytes 0.525 on seed 0)
    # with headroom for RL; 400 ended GRPO under the 0.483 floor (benchmarks/RESULTS.md, "The
    # suite BPE with a shorter SFT").
    # demo_redundant_call=0.6: a sub-agent repeats its tool call at 60% of the places it can, so
    # SFT imitates redundant calls that R_E charges and GRPO can remove. On gold demonstrations
    # every right answer already makes its minimum calls and calls fell only where the policies
    # failed earlier. On 3 seeds SFT ended at 0.520 / 0.495 / 0.545 (gold: 0.540 / 0.560 /
    # 0.525), the policies alone after GRPO at 0.625 / 0.575 / 0.615 (+10.5 / +8.0 / +7.0; gold
    # +7.5 / +7.5 / +3.5), 0.660 / 0.635 / 0.705 with the memory, and their LLM calls per query
    # fell (4.755 -> 4.655, 4.765 -> 4.530, 4.850 -> 4.615; gold: rose) (benchmarks/RESULTS.md,
    # "The imperfect demonstrator: the new default"; 2-core Intel Xeon).
    # sorted_passes: the shared phase's step runs over its demonstrations sorted by length, in
    # passes of batch_per_agent rows each padded to its own longest row instead of the step's
    # longest; the same mean gradient up to rounding (sft.py). The default's rows were half
    # padding (0.511 real tokens, 0.799 sorted), and its warm steps ran 1.83-2.00x faster on
    # a 2-core Intel Xeon (benchmarks/RESULTS.md, "Length-sorted SFT passes"; False: one
    # [A, B, T] batch, T the step's longest row, the default until session 61).
    # demo_seed: the seed of the demonstrator's detours (which train examples' demonstrations
    # repeat a call, try a wrong tool or route); -1 uses `seed`. The detours are part of the
    # SFT data, so a fixed value keeps one dataset across run seeds, as recorded demonstrations
    # would be, and leaves to `seed` the agents' initialization, the SFT batches' order and
    # GRPO's draws.
    # order: each agent's step batch is drawn from its demonstrations with replacement
    # ("random"; over the default's 600 steps the master, with 4,415 demonstrations, never
    # sees a third of them, a different third per seed), or read from a seeded permutation
    # per epoch ("epochs": every demonstration once per epoch). Under demo_seed=0 on seeds
    # 0-9 SFT alone ended at 0.640 (sd 6.7) with "epochs" against 0.624 (sd 5.2): the start
    # is no steadier for seeing every demonstration (benchmarks/RESULTS.md, "What the SFT
    # start's spread comes from").
    c.sft = ml_collections.ConfigDict(dict(steps=600, shared_steps=600, batch_per_agent=8,
                                           learning_rate=5e-3, warmup_steps=20, weight_decay=0.0,
                                           clip_norm=1.0, demo_wrong_route=0.0,
                                           demo_wrong_tool=0.0, demo_redundant_call=0.6,
                                           extra_worlds=0, sorted_passes=True, demo_seed=-1,
                                           order="random"))

    # LoRA (rank 0: full fine-tuning). rank > 0: each agent of the listed groups ("": all) trains
    # its own adapters (scaled by alpha / rank) on the projections whose name matches `targets`,
    # over one frozen base stored once: the shared SFT phase's result (the base trains in full
    # while the agents are one policy), or the initial weights when sft.shared_steps=0. The
    # adapters' optimizer starts at that point (its warmup too).
    c.lora = ml_collections.ConfigDict(dict(rank=0, alpha=16.0, targets="q|k|v|o|gate|up|down",
                                            groups=""))

    # JoyAgents-R1: node-wise sampling at every agent's nodes (branch_agents=""; at the
    # memory's nodes too: memory_branches), every node group with a reward spread (topk=0; K > 0
    # keeps the top K by reward variance), 36 queries per step, learning rate 3e-5, 44 steps.
    # select="agents": the groups of the K agents with the largest mean group variance; K = 3
    # ended the policies alone at 0.673 on the AMD EPYC's seeds 0-4 against 0.679 (30 / 36
    # test queries; benchmarks/RESULTS.md, "The top K agents instead of node groups").
    # With 12 queries and K=5 a step trained 3-4 node groups, and the policies alone ended
    # +2.0 / -0.5 / +2.0 test points over SFT on 3 seeds (0.650 with the memory); with 36
    # queries and every informative group (0-39 per step) +2.5 / +8.0 /
    # +2.0 (0.668 with the memory), for ~1.7x the GRPO phase's time (benchmarks/RESULTS.md,
    # "Three times the queries"); 5e-5 there: +2.5 / -1.0 / -2.5. At 12 queries,
    # 5e-5 cost the policies alone 2.7 points on 3 seeds (two agents stopped copying their
    # observations; "What moves the policies alone"). 12 queries per step (not 6) let the
    # memory cover more of the traffic: +5 to +9.5 test points over SFT on
    # 3 seeds, against -4 to +6.5 with 6. Rollouts sample at temperature 0.3: at 0.7 a tiny
    # policy's sample is 11-19 points worse than its greedy answer and G = 4 samples find no more
    # answers than greedy decoding; at 0.3 a sample is as good and 8 find 14 points more
    # (benchmarks/RESULTS.md, "a diagnosis"). tempered_loss: the loss scores softmax(logits /
    # temperature), the distribution the rollouts drew from (False: the raw policy).
    # share_identical: an alternative equal to an earlier member of its node group is not
    # completed again but takes that member's reward (False: every alternative completed). On
    # 3 seeds the policies alone ended +12.0 / +7.5 / +6.5 test points over SFT with it (0.662
    # with the memory), against +10.5 / +8.0 / +7.0 (0.667), on 647k sampler tokens instead of
    # 954k and ~55% of the GRPO phase's time (benchmarks/RESULTS.md, "Equal outputs completed
    # once"). No effect in trajectory or full_tree mode (no node groups).
    # suffix_credit: in node groups with a reward spread, the nodes each alternative sampled
    # after its branch are trained too, with that alternative's advantage (trajectory GRPO's
    # credit for the suffix; samples then carry advantages, so it needs topk=0 and
    # advantage="std"). False: only node-group members train. On seed 0 at the default's
    # sampler tokens the policies alone ended at 0.620 with it against 0.640 (0.715 with the
    # memory against 0.675) for 1.3x the time (benchmarks/RESULTS.md, "Training the
    # alternatives' later nodes"). No effect outside node-wise mode.
    # greedy_completions: node-wise rollouts decode tau0 and each alternative's later nodes
    # greedily (as evaluation does); only the alternatives at the branch node are sampled.
    # False: every node sampled at `temperature`. On 3 seeds at the default's sampler tokens
    # the policies alone ended 0.670 / 0.615 / 0.570 against 0.640 / 0.570 / 0.610, inside the
    # spread (benchmarks/RESULTS.md, "Greedy completions"). No effect outside node-wise mode.
    # memory_groups="drop" leaves out node groups whose episodes hold a memory answer, so GRPO
    # learns only from episodes the policies produced alone ("keep": all). min_groups > 0 turns
    # on dynamic sampling (DAPO): while fewer node groups than that have a reward spread, up to
    # max_refills more batches of `queries` fresh train queries are rolled out (0: off).
    # query_order: "traffic" draws GRPO's queries from the train split as recorded (popular
    # questions as often as users ask them); "questions" from its distinct questions, each once
    # per epoch (rare questions, where the SFT policies fail most, as often as popular ones).
    # query_power = p < 1 (traffic order): a question with n train records keeps its first
    # ceil(n ** p) of them in GRPO's pool, so popular questions are asked less often and rare
    # ones relatively more (0: one record per question; 1: the traffic as recorded). At 0.5
    # the policies alone ended at 0.676 on the AMD EPYC's seeds 0-4 against 0.679 (24 / 27
    # test queries won / lost), 0.733 with the memory against 0.716 (benchmarks/RESULTS.md,
    # "Rare questions asked more often").
    # w_grounding > 0 adds R_G to GRPO's reward: the share of the words agents copy into tool
    # arguments and answers that occur in what they read (0: the paper's R_A + R_F - R_E);
    # grounding_match "word" counts verbatim words only, "chars" gives near copies partial
    # credit by character similarity. memory_branches: node-wise rollouts also branch at the
    # nodes the memory answered, the stored output one member of the node group and G - 1
    # policy samples the others (False: memory-answered nodes train nothing). Without it the
    # memory answers the popular questions in the rollouts, GRPO never sees the policies' own
    # answers to them, and updates for other questions break some unseen: on 3 seeds the
    # policies alone ended +6.5 / +7.5 / +3.5 test points over SFT with it, against +2.5 / +8.0
    # / +2.0, for ~1.7x the sampler tokens (benchmarks/RESULTS.md, "The memory's nodes in the
    # node groups"). No effect where rollouts do not read the memory (trajectory or full_tree
    # mode, memory.enabled or memory.in_rollouts False).
    # subagent_credit: R_A of a sub-agent's node is its call's own answer checked against the
    # gold trajectory's (False: the episode's R_A), so node groups see a sub-agent error the
    # master repairs. It corrected such an error within 6 steps (efc-0001 on the Intel host's
    # seed 2; a later step broke the question in both agents), but on 3 seeds at the default's
    # sampler tokens the policies alone ended 0.620 / 0.525 / 0.580 against the default's
    # 0.620 / 0.540 / 0.590 (benchmarks/RESULTS.md, "The master's repairs hide the sub-agents'
    # errors"). No effect outside node-wise mode.
    # branch_agents: a comma list of config.agents whose nodes node-wise rollouts branch at
    # (G_i = group_size there); the others keep tau0's output (G_i = 1), sample no alternatives,
    # train nothing in GRPO and write no memory entries ("": every agent, the paper's joint
    # node-wise sampling). With the suite BPE two thirds of the remaining test errors start at
    # the master's nodes, and its node groups lift the policies alone to 0.630 / 0.610 / 0.700
    # on seeds 0-2 against 0.605 / 0.585 / 0.640 with the sub-agents' only (0.725 / 0.695 /
    # 0.740 with the memory against 0.700 / 0.660 / 0.680; benchmarks/RESULTS.md, "The suite
    # BPE with a shorter SFT"). The byte default (`byte_default()`) branches at the sub-agents'
    # nodes only ("qa,efc,gfc,math"): there freezing the master's updates cost nothing and its
    # ~30% of the sampler tokens bought more sub-agent steps ("Node groups at the sub-agents'
    # nodes only"). No effect outside node-wise mode.
    # unbranched_memory: the agents outside branch_agents (none by default; the master in
    # `byte_default()`) keep tau0's outputs, and these join the memory's candidates as
    # one-member node groups that train nothing, so the memory also answers the master's
    # repeated nodes: "eval" (the default since 2026-12-02)
    # at evaluation only, GRPO's rollouts reading the branched agents' entries as before; "all"
    # in the rollouts too; "off": the unbranched agents write no entries. On the Intel host's
    # seeds 0-2 "eval" trained exactly what "off" trains (the same steps, tokens and answers of
    # the policies alone) and ended at 0.690 / 0.630 / 0.700 with the memory against 0.675 /
    # 0.595 / 0.675 (+15.5 / +12.0 / +11.0 over SFT), with 1.275 / 1.555 / 1.150 LLM calls per
    # query instead of 2.715 / 2.970 / 2.660; "all" changed the training rollouts and left the
    # policies alone 3.0 and 1.5 points lower on seeds 1-2 (benchmarks/RESULTS.md, "The
    # master's outputs in the memory"). No effect outside node-wise mode.
    # branch_min_change = m > 0: node-wise rollouts branch only at tau0's sampled nodes where
    # one more sample would differ from tau0's output with chance >= m (one minus the output's
    # probability under the sampling distribution); at the others the G - 1 alternatives would
    # mostly repeat it (89% of the default's alternatives equalled an earlier member of their
    # group on seed 0, and 11% of its node groups had a reward spread), so their tokens buy
    # steps instead. A memory-answered node is settled when a first policy sample equals the
    # stored output and is that likely (else that sample is one of its alternatives). Settled
    # sampled nodes still reach the memory, as one-member node groups that train nothing.
    # On seed 0 at the default's sampler tokens m = 0.05 took 66 steps instead of 44, and the
    # policies alone ended at 0.610 (0.625 with 54 queries per step) against the default's
    # 0.645 (benchmarks/RESULTS.md, "Fewer alternatives where a sample would repeat tau0"):
    # off. 0: every node. Needs sampled tau0 outputs (greedy_completions=False). No effect
    # outside node-wise mode.
    # advantage: "std" ((r - group mean) / group std, GRPO), "no_std" (r - mean, Dr. GRPO) or
    # "loo" (r - the other members' mean, RLOO). Without the std the efficiency term barely
    # moves a group: on the AMD EPYC's seeds 0-4 "loo" left the policies alone at 0.658 against
    # 0.679 (23 / 44 test queries won / lost) with fewer calls removed (benchmarks/RESULTS.md,
    # "Leave-one-out advantages"; "no_std": "Dr. GRPO's advantages under replay").
    # neg_weight scales negative advantages (1: GRPO; 0: only samples that beat their group's
    # mean are reinforced). 0.25 moved the policies alone less than 1 on 3 seeds (+0.7 against
    # +2.3 points; benchmarks/RESULTS.md, "down-weighted negatives"). gold_branches: where a
    # rollout leaves its train query's gold trajectory at a node, the gold output joins that
    # node group as one more member (off-policy guidance, as LUFFY), so GRPO sees the answer the
    # samples miss (False: policy samples only). On the AMD EPYC's ten seeds the policies alone
    # ended at 0.704 with it against 0.698 (77 / 65 test queries), and node-wise GRPO without
    # the memory gained alike (0.689 against 0.680), so the default's lead over it stays +1.5
    # (benchmarks/RESULTS.md, "The gold member in both node-wise modes on ten seeds"). optimizer: "adamw", or "sgd" (momentum 0.9: steps
    # scale with the gradient, where Adam moves every parameter about as far): on seed 1 at
    # learning rates 2e-4 and 1e-3 the policies alone ended 1.0 and 2.5 points below SFT,
    # against 0.5 with AdamW (benchmarks/RESULTS.md, "Which test answers GRPO changes").
    # self_imitation = n > 0: after each GRPO step every agent also takes one supervised step on
    # up to n of its memory entries with the best R_A + R_F (stored prompt -> stored output,
    # drawn by (seed, step)), so the policies learn what the memory answers (0: off; needs the
    # memory). With 8 the policies alone ended at 0.590 / 0.555 on two seeds against the
    # default's 0.620 / 0.540 and trajectory GRPO's 0.620 / 0.570 (benchmarks/RESULTS.md,
    # "Self-imitation in the package").
    # replay = R > 0: each GRPO step asks again (in place of R fresh traffic queries) up to R of
    # the previous step's queries that had a node group with a reward spread, the ones GRPO
    # just learned from, while the memory holds that step's best outputs for their nodes: the
    # memory answers them in the rollout and its outputs join node groups (memory_branches),
    # so its answers train the policies again (0: every query fresh, from `query_order`). 12 is
    # the default since session 70: on an AMD EPYC (family 25 model 17) the policies alone
    # ended at 0.640 / 0.670 / 0.675 / 0.710 / 0.665 on seeds 0-4 against 0.615 / 0.620 / 0.655
    # / 0.740 / 0.635 with 0 (the default of sessions 64-69; 59 / 40 test queries won / lost),
    # and at least 10 points over SFT with the memory on every seed, where 0 fell short on seed
    # 1 (benchmarks/RESULTS.md, "Re-asking as the default").
    # schedule: "constant" learning rate after warmup, or "cosine" decay from the peak to 0
    # over warmup_steps + steps * inner_steps optimizer updates (each agent's schedule counts
    # its own updates, so an agent that some steps leave out ends above 0). Cosine from 6e-5
    # (a mean of 3e-5) left the policies alone at 0.660 / 0.670 / 0.620 on seeds 0-2 against
    # 0.640 / 0.670 / 0.675: it learns faster early and stops from step 20-30 on
    # (benchmarks/RESULTS.md, "A cosine learning-rate decay").
    # seed: the seed of GRPO's randomness (its queries, samples, refills and self-imitation
    # draws); -1 uses `seed`. The SFT phase depends on `seed` alone, so another value runs a
    # second RL seed from the same end-of-SFT checkpoint, which separates the spread GRPO
    # adds from the spread of the SFT policies it starts from.
    # select_every = N > 0: every N GRPO steps and after the last, the policies alone answer
    # `select_examples` train records (one seeded slice, greedy, without the memory), and the
    # run reports and exports the best-scoring step's policies (the latest on ties) beside its
    # last memory; training is unchanged (`joyagents_jax/selection.py`). 0: the last step's
    # policies (the default before session 86). On an AMD EPYC (family 26 model 2) the
    # default's policies alone ended at 0.665 / 0.660 / 0.670 / 0.725 / 0.675 on seeds 0-4
    # with N = 4 and 360 records, against the last step's 0.640 / 0.645 / 0.640 / 0.685 / 0.660
    # (37 / 12 test queries won / lost), for ~47 s of the default's run; 120 records chose a
    # worse step on seed 4 (0.630; benchmarks/RESULTS.md, "Which iterate each selection rule
    # chooses").
    # select_split: where the slice comes from: "train" (the records GRPO also trains on) or
    # "validation" (held-out records of the same traffic as `test`, never trained on; the
    # assistant suite's 200, all of them with select_examples >= 200; GSM8K has none). On the
    # AMD EPYC's seeds 0-9 validation chose another step in 9 of 30 runs of the default and
    # both baselines, and no better: the default alone 0.699 against 0.698 (21 / 18 test
    # queries; benchmarks/RESULTS.md, "Choosing the iterate on the held-out validation split").
    # domain_repeats: a comma list "domain=n" (e.g. "cooperation=2"): every train record of that
    # domain stands n times in GRPO's query pool (after query_order and query_power), so its
    # queries are asked n times as often; the domains are the dataset's (the assistant suite's
    # math, qa, efc, gfc, cooperation; GSM8K's math). "": every record once. With
    # "cooperation=2" (34% of the pool instead of 21%) every mode answered more cooperation
    # queries on the AMD EPYC's seeds 0-4, and the default's leads over trajectory and node-wise
    # GRPO fell to +1.3 / +1.1 points from +1.2 / +1.6 (benchmarks/RESULTS.md, "Cooperation
    # queries asked twice as often").
    # memory_members = k: with memory_branches, the memory's stored output counts as k members
    # of its node group (its reward k times in the group's mean and std, its row k times in
    # the loss), so at a node where the policy's samples contest a stored answer its pull
    # matches theirs (1: one member like each sample). With k = 3 the policies alone ended at
    # 0.672 on the AMD EPYC's seeds 0-4 against 0.679 (19 / 26 test queries won / lost;
    # benchmarks/RESULTS.md, "The memory's member counted three times"). No effect where
    # memory_branches has none.
    # eps_low / eps_high: the ratio's clip range (0.28: DAPO's clip-higher). In the README
    # run of seed 0 one of 220 agent-steps saw a ratio above 1.2 (efc, 1.35; 0.11% of its
    # tokens clipped): at learning rate 3e-5 neither bound binds, so eps_high is inert here
    # (benchmarks/RESULTS.md, "Where the clip binds").
    c.grpo = ml_collections.ConfigDict(dict(
        steps=44, queries=36, group_size=4, mode="nodewise", topk=0, select="groups",
        micro_batch=16, inner_steps=2, beta=0.04, eps_low=0.2, eps_high=0.28, kl="k3",
        aggregation="seq_mean_token_mean", advantage="std", optimizer="adamw",
        learning_rate=3e-5, schedule="constant", warmup_steps=0, clip_norm=1.0,
        temperature=0.3, tempered_loss=False, top_p=1.0, top_k=0, memory_groups="keep",
        w_format=0.1, w_efficiency=0.05, w_grounding=0.0, min_groups=0, max_refills=2,
        query_order="traffic", grounding_match="word", memory_branches=True, neg_weight=1.0,
        gold_branches=False, share_identical=True, suffix_credit=False, greedy_completions=False,
        self_imitation=0, subagent_credit=False, branch_agents="", branch_min_change=0.0,
        unbranched_memory="eval", replay=12, seed=-1, select_every=4, select_examples=360,
        select_split="train", memory_members=1, query_power=1.0, domain_repeats=""))

    # Reuse needs a (near-)identical node input: with mean-pooled embeddings of a tiny model,
    # different prompts of one agent reach cosine 0.9996 (measured). Hints are off by default
    # (hints=False): SFT never shows hints, so a tiny model cannot use them. in_rollouts: the
    # memory answers the nodes of GRPO's training rollouts too (False: evaluation only; it is
    # still written from the rollouts' rewards).
    c.memory = ml_collections.ConfigDict(dict(
        enabled=True, capacity=256, response_len=96, request_len=64, tau_reuse=0.99995,
        tau_hint=0.9995, hints=False, reuse=True, reuse_min_reward=1.0, tau_dup=0.99995, z=1.96,
        decay_steps=50.0, alpha=1.0, beta=1.0, embed_batch=32, in_rollouts=True))

    # Held-out evaluation at the end of SFT and of GRPO, and every `sft_every` SFT steps and
    # `grpo_every` GRPO steps (counted within the phase; 0: phase ends only). During GRPO it also
    # evaluates the policies without the memory (eval_no_memory/...). It changes nothing the run
    # trains; the default evaluates at the phase ends only since session 64, since its four
    # points at GRPO steps 10-40 (grpo_every=10) took ~2.5 of its minutes on 2 cores
    # (`benchmarks/learning_study.py --eval_every` draws the curve).
    c.eval = ml_collections.ConfigDict(dict(sft_every=0, grpo_every=0, examples=200,
                                            splits=("test", "test_novel")))
    # every=0: only at the end of each phase and on preemption.
    c.checkpoint = ml_collections.ConfigDict(dict(every=20, keep=3))
    # A workdir whose checkpoints are all unreadable is refused unless restart=True (which sets
    # the old checkpoints and logs aside and starts again from step 0).
    c.restart = False
    # Consecutive steps dropped for a non-finite loss, gradient or update before the run stops.
    c.max_skipped_steps = 5
    return c


# The default of sessions 57-63 as overrides of this one (`byte_default()`).
BYTE_DEFAULT = {"tokenizer": "bytes", "groups.all.model": "tiny", "max_len": 512,
                "sampler.min_prompt_bucket": 256, "sft.steps": 900, "sft.shared_steps": 900,
                "grpo.branch_agents": ",".join(SUB_AGENTS), "eval.grpo_every": 10,
                "grpo.replay": 0}


def domain_repeats(text: str) -> dict[str, int]:
    """`grpo.domain_repeats` read: "cooperation=2,math=3" -> {"cooperation": 2, "math": 3}, ""
    -> {}. ValueError names the part that is not "domain=n" with a whole n >= 1, or a domain
    given twice."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        domain, _, n = part.partition("=")
        domain = domain.strip()
        if not domain or not n.strip().isdigit() or int(n) < 1:
            raise ValueError(f"{part!r} is not 'domain=n' with a whole n >= 1")
        if domain in out:
            raise ValueError(f"domain {domain!r} is given twice")
        out[domain] = int(n)
    return out


def byte_default() -> ml_collections.ConfigDict:
    """The default of sessions 57-63: byte tokenizer, 900 SFT steps, node groups at the
    sub-agents' nodes only. On an AMD EPYC's seeds 0-2 the policies alone ended at 0.645 /
    0.560 / 0.585 (0.670 / 0.680 / 0.675 with the memory) on ~670k sampler tokens; seed 0 ran
    33:52 on a 2-core Intel Xeon (benchmarks/RESULTS.md)."""
    return override(get_config(), BYTE_DEFAULT)


def override(c: ml_collections.ConfigDict, values: dict) -> ml_collections.ConfigDict:
    """`c` with {"dotted.key": value} set in place (e.g. {"grpo.topk": 2})."""
    for key, value in values.items():
        node = c
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return c


def real_checkpoint_config(groups: dict[str, tuple[tuple[str, ...], str]]
                           ) -> ml_collections.ConfigDict:
    """Settings for real Qwen2.5 checkpoints: groups {name: (agents, HF folder)}.

    bf16 with remat, sharded over all devices (fsdp), the chat template of the first group's
    folder, longer nodes, small learning rates, larger memory, gold demonstrations (the tiny
    default's repeated calls give its GRPO redundant calls to remove).
    """
    c = get_config()
    c.tokenizer = next(iter(groups.values()))[1]
    c.groups = {name: {"agents": tuple(agents), "model": "", "checkpoint": folder}
                for name, (agents, folder) in groups.items()}
    c.param_dtype, c.dtype, c.remat, c.mesh = "bfloat16", "bfloat16", True, "fsdp=-1"
    c.agents_per_pass = 0  # all agents of a group in one pass, as `joyagents plan` measured
    c.max_len = 2048
    c.limits.update(max_nodes=8, max_tokens_per_node=256, max_observation_chars=512)
    c.sampler.decode_phases = 4  # 256-token nodes: early steps skip most of the cache
    c.sft.update(steps=200, shared_steps=0, batch_per_agent=8, learning_rate=1e-5,
                 warmup_steps=20, demo_redundant_call=0.0)  # gold demonstrations
    c.grpo.update(steps=300, queries=32, group_size=8, learning_rate=1e-6, warmup_steps=10,
                  topk=16, temperature=0.7)  # 0.3 is for the tiny default's weak samples
    c.memory.update(capacity=4096, response_len=256, request_len=256)
    c.grpo.select_every = 50  # scored as often as evaluated: 360 episodes of long nodes
    c.eval.update(sft_every=50, grpo_every=50, examples=500)
    c.checkpoint.update(every=25, keep=3)
    return c
