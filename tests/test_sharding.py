"""Mesh, partition rules and their validation (1 device, in process), and sharded execution on
8 fake CPU devices (a subprocess: the device count is fixed when JAX starts)."""

import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from joyagents_jax import sharding, xla_flags
from joyagents_jax.models import hf_io, qwen2
from joyagents_jax.rl import grpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small, but every split dimension divides 8: heads 8, kv heads 2, hidden 64, vocab 256.
CFG = qwen2.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=8, num_kv_heads=2, rope_theta=1e4)
SIZES = {"agent": 1, "data": 2, "fsdp": 2, "tensor": 2}


def run_python(code: str, devices: int | None = 8, timeout: float = 300) -> str:
    """Runs `code` in a fresh interpreter at the repo root (with `devices` fake CPU devices),
    under the suite's XLA flags."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if devices:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""),
                                     f"--xla_force_host_platform_device_count={devices}"])
        xla_flags.enough_cpu_threads(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return proc.stdout


# ----------------------------------------------------------------------------------------------
# Mesh.
# ----------------------------------------------------------------------------------------------

def test_mesh_shape_resolves_the_rest():
    assert sharding.mesh_shape({}, 8) == {"agent": 1, "data": 1, "fsdp": 8, "tensor": 1}
    assert sharding.mesh_shape({"data": 2, "tensor": 2}, 8)["fsdp"] == 2
    assert sharding.mesh_shape({"data": -1, "tensor": 2}, 8) == {
        "agent": 1, "data": 4, "fsdp": 1, "tensor": 2}
    assert sharding.mesh_shape(sharding.parse_mesh("agent=2, fsdp=4"), 8)["agent"] == 2


@pytest.mark.parametrize("sizes, devices, message", [
    ({"data": 2, "fsdp": 8}, 8, "Mesh agent=1 × data=2 × fsdp=8 × tensor=1 needs 16 devices, "
                                "but only 8 are available"),
    ({"data": -1, "fsdp": -1}, 8, "Only one mesh axis may be -1"),
    ({"tensor": 3}, 8, "Cannot give mesh axis 'fsdp' the rest of the devices: 8 devices are not "
                       "divisible by the other axes' product 3"),
    ({"fsdp": 2}, 8, "uses 2 of 8 devices; set one axis to -1"),
    ({"model": 2}, 8, "Unknown mesh axes ['model']"),
    ({"data": 0}, 8, "must be positive or -1"),
])
def test_mesh_shape_errors(sizes, devices, message):
    with pytest.raises(sharding.ShardingError) as e:
        sharding.mesh_shape(sizes, devices)
    assert message in str(e.value)


def test_make_mesh_larger_than_device_count():
    with pytest.raises(sharding.ShardingError, match="needs 2 devices, but only 1 are available"):
        sharding.make_mesh("data=2")


def test_parse_mesh_error():
    with pytest.raises(sharding.ShardingError, match="Cannot parse mesh item 'fsdp:4'"):
        sharding.parse_mesh("data=2,fsdp:4")


def test_make_mesh_axes_are_auto():
    mesh = sharding.make_mesh()
    assert mesh.axis_names == sharding.MESH_AXES
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


# ----------------------------------------------------------------------------------------------
# Rules.
# ----------------------------------------------------------------------------------------------

EXPECTED_SPECS = {
    "embed": P("tensor", "fsdp"),
    "layers/attn/q/kernel": P(None, "fsdp", "tensor"),
    "layers/attn/k/bias": P(None, "tensor"),
    "layers/attn/o/kernel": P(None, "tensor", None, "fsdp"),
    "layers/mlp/up/kernel": P(None, "fsdp", "tensor"),
    "layers/mlp/down/kernel": P(None, "tensor", "fsdp"),
    "layers/input_norm/scale": P(),
    "final_norm/scale": P(),
    "lm_head/kernel": P("fsdp", "tensor"),
}


def _flat(tree) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, P))[0]
    return {sharding.path_str(p): x for p, x in leaves}


def test_qwen2_rules_place_every_leaf():
    untied = qwen2.param_shapes(CFG.replace(tie_embeddings=False))
    specs = _flat(sharding.param_specs(untied, SIZES))
    for path, spec in EXPECTED_SPECS.items():
        assert specs[path] == spec, path


def test_stacked_group_puts_agents_on_the_agent_axis():
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((4, *x.shape), x.dtype),
                           qwen2.param_shapes(CFG))
    specs = _flat(sharding.param_specs(stacked, SIZES, stacked=True))
    assert specs["layers/attn/q/kernel"] == P("agent", None, "fsdp", "tensor")
    assert specs["final_norm/scale"] == P("agent")
    agents_over_3 = sharding.mesh_shape({"agent": 3, "fsdp": -1}, 6)
    with pytest.raises(sharding.ShardingError, match=r"dimension 0 \(size 4\) is not divisible "
                                                     r"by mesh axis agent of size 3"):
        sharding.param_specs(stacked, agents_over_3, stacked=True)


def test_optimizer_state_follows_its_parameter():
    params = qwen2.param_shapes(CFG)
    state = _flat(sharding.param_specs(jax.eval_shape(optax.adamw(1e-3).init, params), SIZES))
    assert state["0/mu/layers/attn/q/kernel"] == P(None, "fsdp", "tensor")
    assert state["0/nu/embed"] == P("tensor", "fsdp")
    assert state["0/count"] == P()


def test_unmatched_path_error():
    tree = {"layers": {"adapter": {"kernel": jax.ShapeDtypeStruct((2, 8, 8), jnp.float32)}}}
    with pytest.raises(sharding.ShardingError) as e:
        sharding.param_specs(tree, SIZES)
    assert "No partition rule matches layers/adapter/kernel [2, 8, 8]" in str(e.value)
    assert "add a (regex, PartitionSpec) rule" in str(e.value)


def test_rule_naming_an_unknown_mesh_axis_error():
    tree = {"embed": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    with pytest.raises(sharding.ShardingError) as e:
        sharding.param_specs(tree, SIZES, rules=((r"embed$", P("model", None)),))
    assert "embed: spec P('model', None) names mesh axes ['model'], which the mesh" in str(e.value)


def test_rule_longer_than_tensor_error():
    tree = {"embed": jax.ShapeDtypeStruct((16,), jnp.float32)}
    with pytest.raises(sharding.ShardingError, match="more entries than the tensor has dimensions"):
        sharding.param_specs(tree, SIZES)


def test_indivisible_dimension_error_names_tensor_dimension_axis_and_size():
    sizes = {"agent": 1, "data": 1, "fsdp": 2, "tensor": 4}  # kv heads 2 over tensor 4
    with pytest.raises(sharding.ShardingError) as e:
        sharding.param_specs(qwen2.param_shapes(CFG), sizes)
    assert ("Cannot shard layers/attn/k/bias [2, 2, 8]: dimension 1 (size 2) is not "
            "divisible by mesh axis tensor of size 4") in str(e.value)
    assert "on_indivisible='replicate'" in str(e.value)


def test_indivisible_dimension_replicated_when_asked(caplog):
    sizes = {"agent": 1, "data": 1, "fsdp": 2, "tensor": 4}
    with caplog.at_level(logging.WARNING):
        specs = _flat(sharding.param_specs(qwen2.param_shapes(CFG), sizes,
                                           on_indivisible="replicate"))
    assert specs["layers/attn/k/kernel"] == P(None, "fsdp")
    assert specs["layers/attn/q/kernel"] == P(None, "fsdp", "tensor")
    assert "Replicating layers/attn/k/kernel [2, 64, 2, 8]: dimension 2" in caplog.text


def test_multi_axis_dimension_error():
    tree = {"x": jax.ShapeDtypeStruct((6, 4), jnp.float32)}
    with pytest.raises(sharding.ShardingError) as e:
        sharding.param_specs(tree, SIZES, rules=((r"x$", P(("data", "fsdp"))),))
    assert "x [6, 4]: dimension 0 (size 6) is not divisible by mesh axis data×fsdp of size 4" in (
        str(e.value))


def test_batch_not_divisible_error():
    sharding.check_batch(SIZES, 8)
    with pytest.raises(sharding.ShardingError) as e:
        sharding.check_batch(SIZES, 6)
    assert str(e.value) == ("Batch size 6 is not divisible by the data-parallel size 4 (mesh axes "
                            "data=2 × fsdp=2); use a multiple of 4.")


def test_replicate_places_host_values_on_every_device():
    mesh = sharding.make_mesh()
    tree = {"step": np.int32(3), "table": np.arange(6.0).reshape(2, 3)}
    out = sharding.replicate(tree, mesh)
    for k in tree:
        assert out[k].sharding.is_fully_replicated and out[k].sharding.mesh == mesh
        np.testing.assert_array_equal(out[k], tree[k])
    assert sharding.replicate(tree, None) is tree


def test_batch_specs():
    assert sharding.batch_spec() == P(("data", "fsdp"))
    assert sharding.batch_spec(stacked=True) == P("agent", ("data", "fsdp"))


# ----------------------------------------------------------------------------------------------
# Sharded execution on 8 fake devices.
# ----------------------------------------------------------------------------------------------

MESHES = {"fsdp4_tensor2": "fsdp=4,tensor=2", "fsdp8": "fsdp=8", "data2_fsdp4": "data=2,fsdp=4"}


def device_report() -> dict:
    """Runs in the 8-device subprocess: sharded vs unsharded forward and AdamW step per mesh."""
    jax.config.update("jax_default_matmul_precision", "highest")
    cfg = CFG.replace(tie_embeddings=False)
    params = jax.jit(lambda k: qwen2.init_params(cfg, k))(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, cfg.vocab_size)
    # eps 1e-4, not 1e-8: some gradients are ~0 (k biases are exactly 0 in exact arithmetic:
    # softmax is shift invariant), and Adam would blow their rounding noise up to a full step.
    tx = optax.adamw(1e-2, eps=1e-4, weight_decay=0.1)

    def step(params, opt_state, tokens):  # -> logits, params, opt_state
        def loss(p):
            logits = qwen2.forward(cfg, p, tokens).logits
            return -jnp.mean(grpo.token_logprobs(logits[:, :-1], tokens[:, 1:])), logits
        grads, logits = jax.grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return logits, optax.apply_updates(params, updates), opt_state

    opt = jax.jit(tx.init)(params)
    want = jax.jit(step)(params, opt, tokens)
    params, opt = jax.device_get((params, opt))  # host copies: placing them needs no compile
    report = {}
    for name, text in MESHES.items():
        mesh = sharding.make_mesh(text)
        p_sh, o_sh = sharding.param_shardings(mesh, params), sharding.param_shardings(mesh, opt)
        args = sharding.shard_params(params, p_sh), sharding.shard_params(opt, o_sh), tokens
        got = jax.jit(step, in_shardings=(p_sh, o_sh, sharding.batch_sharding(mesh)),
                      out_shardings=(None, p_sh, o_sh))(*args)
        leaves = _flat(got[1]) | {f"opt/{k}": v for k, v in _flat(got[2]).items()}
        report[name] = {
            "mesh": dict(mesh.shape),
            "diffs": [relative_diff(g, w) for g, w in zip(got, want)],
            "specs": {k: str(v.sharding.spec) for k, v in leaves.items()},
            "shard_shapes": {k: list(v.addressable_shards[0].data.shape)
                             for k, v in leaves.items()},
        }
    report["stacked_agent2"] = stacked_report(cfg, params, tokens, want[0])
    report["hf_load"] = hf_load_report(cfg, params)
    report["init"] = init_report(cfg, params)
    report["sorted_sft"] = sorted_sft_report(cfg, params)
    return report


def relative_diff(a, b) -> float:
    """Worst leaf of max|a - b| / max|b|: rounding-level when sharding changes nothing else."""
    pairs = zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)))
    return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)) for x, y in pairs)


def stacked_report(cfg, params, tokens, logits) -> dict:
    """Two agents on their own mesh axis: the vmapped sharded forward matches `logits`.

    Agent 1 has a doubled lm_head, so its logits are exactly 2x the unsharded ones.
    """
    mesh = sharding.make_mesh("agent=2,fsdp=2,tensor=2")
    doubled = params | {"lm_head": {"kernel": 2 * params["lm_head"]["kernel"]}}
    stacked = jax.tree.map(lambda *x: np.stack(x), params, doubled)
    p_sh = sharding.param_shardings(mesh, stacked, stacked=True)
    sharded = sharding.shard_params(stacked, p_sh)
    fwd = jax.vmap(lambda p, t: qwen2.forward(cfg, p, t).logits)
    got = jax.jit(fwd, in_shardings=(p_sh, sharding.batch_sharding(mesh, stacked=True)))(
        sharded, tokens.reshape(2, 4, -1))
    q = sharded["layers"]["attn"]["q"]["kernel"]
    return {"diff": relative_diff(got, jnp.stack([logits[:4], 2 * logits[4:]])),
            "q_spec": str(q.sharding.spec), "q_shard": list(q.addressable_shards[0].data.shape)}


def hf_load_report(cfg, params) -> dict:
    """HF folder -> params loaded straight into their shardings."""
    mesh = sharding.make_mesh("fsdp=4,tensor=2")
    with tempfile.TemporaryDirectory() as folder:
        hf_io.save_params(folder, cfg, params)
        loaded, _ = sharding.load_hf_params(folder, mesh)
    want = sharding.param_shardings(mesh, params)
    pairs = zip(jax.tree.leaves(loaded), jax.tree.leaves(want))
    same_sharding = all(a.sharding == s for a, s in pairs)
    diff = max(float(jnp.max(jnp.abs(a - b)))
               for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)))
    return {"diff": diff, "same_sharding": same_sharding}


def init_report(cfg, params) -> dict:
    """Random init straight into shardings gives the same values as the unsharded init."""
    mesh = sharding.make_mesh("fsdp=4,tensor=2")
    sharded = sharding.init_params(cfg, jax.random.key(0), mesh)
    q = sharded["layers"]["attn"]["q"]["kernel"]
    return {"diff": relative_diff(sharded, params), "q_spec": str(q.sharding.spec)}


def sorted_sft_report(cfg, params) -> dict:
    """Two equal agents' shared SFT over length-sorted passes on an agent=2,data=2,fsdp=2 mesh
    against the same two steps unsharded: the largest relative difference of the params."""
    from joyagents_jax import batching, sft
    from joyagents_jax import train_state as ts
    rng = np.random.default_rng(0)
    demos = [(agent, rng.integers(1, 256, int(rng.integers(4, 100))).tolist(),
              rng.integers(1, 256, int(rng.integers(1, 20))).tolist())
             for agent in ("a", "b") for _ in range(6)]
    slots, sizes = {"a": ("all", 0), "b": ("all", 1)}, {"all": 2}
    passes = batching.sorted_passes(demos, slots, sizes, rows=4, max_len=128)
    stacked = jax.tree.map(lambda x: np.stack([x, x]), params)
    optim = ts.OptimConfig(learning_rate=1e-2, schedule="constant", eps=1e-4)
    fresh = lambda: ts.create({"all": ts.init_group(cfg, optim, stacked)})
    mesh = sharding.make_mesh("agent=2,data=2,fsdp=2")
    states = {"plain": fresh(), "mesh": jax.device_put(fresh(), ts.state_shardings(fresh(), mesh))}
    steps = {"plain": sft.make_sorted_sft_step(), "mesh": sft.make_sorted_sft_step(mesh)}
    for name in states:
        for _ in range(2):
            states[name], _ = steps[name](states[name], passes)
    q = states["mesh"].groups["all"].params["layers"]["attn"]["q"]["kernel"]
    return {"diff": relative_diff(states["mesh"].groups["all"].params,
                                  states["plain"].groups["all"].params),
            "lengths": [int(b.tokens.shape[1]) for b in passes["all"]],
            "q_spec": str(q.sharding.spec)}


@pytest.fixture(scope="module")
def report() -> dict:
    out = run_python("import json; from tests.test_sharding import device_report; "
                     "print('REPORT' + json.dumps(device_report()))")
    return json.loads(out.split("REPORT", 1)[1])


@pytest.mark.parametrize("name", sorted(MESHES))
def test_sharded_forward_and_adamw_step_match_unsharded(report, name):
    logits, params, opt_state = report[name]["diffs"]
    assert logits < 1e-5
    # Adam moves a weight by lr * g / (|g| + eps): rounding delta in a near-zero gradient moves
    # it by lr * delta / eps = 100 delta (1.06e-5 of the largest weight measured on an AMD EPYC,
    # under 1e-5 on Intel). A wrongly sharded step is off by O(lr) = 1e-2.
    assert params < 1e-4
    assert opt_state < 1e-4


@pytest.mark.parametrize("name", sorted(MESHES))
def test_parameters_are_split_as_the_rules_say(report, name):
    r, m = report[name], report[name]["mesh"]
    d, l, v, f, n, k, hd = 64, 2, 256, 128, 8, 2, 8
    fsdp, tensor = m["fsdp"], m["tensor"]
    expected = {
        "embed": (P("tensor", "fsdp"), [v // tensor, d // fsdp]),
        "lm_head/kernel": (P("fsdp", "tensor"), [d // fsdp, v // tensor]),
        "layers/attn/q/kernel": (P(None, "fsdp", "tensor"), [l, d // fsdp, n // tensor, hd]),
        "layers/attn/k/kernel": (P(None, "fsdp", "tensor"), [l, d // fsdp, k // tensor, hd]),
        "layers/attn/o/kernel": (P(None, "tensor", None, "fsdp"), [l, n // tensor, hd, d // fsdp]),
        "layers/mlp/gate/kernel": (P(None, "fsdp", "tensor"), [l, d // fsdp, f // tensor]),
        "layers/mlp/down/kernel": (P(None, "tensor", "fsdp"), [l, f // tensor, d // fsdp]),
        "layers/input_norm/scale": (P(), [l, d]),
        "opt/0/mu/layers/attn/q/kernel": (P(None, "fsdp", "tensor"),
                                          [l, d // fsdp, n // tensor, hd]),
        "opt/0/count": (P(), []),
    }
    for path, (spec, shard) in expected.items():
        assert r["specs"][path] == str(spec), path
        assert r["shard_shapes"][path] == shard, path


def test_agent_axis_as_its_own_mesh_axis(report):
    r = report["stacked_agent2"]
    assert r["diff"] < 1e-5
    assert r["q_spec"] == str(P("agent", None, "fsdp", "tensor"))
    assert r["q_shard"] == [1, 2, 32, 4, 8]


def test_hf_weights_load_straight_into_shardings(report):
    assert report["hf_load"] == {"diff": 0.0, "same_sharding": True}


def test_random_init_straight_into_shardings(report):
    assert report["init"] == {"diff": 0.0, "q_spec": str(P(None, "fsdp", "tensor"))}


def test_sorted_sft_passes_on_a_mesh_match_unsharded(report):
    r = report["sorted_sft"]
    assert len(set(r["lengths"])) > 1  # passes of their own lengths, rows over data x fsdp
    assert r["q_spec"] == str(P("agent", None, "fsdp", "tensor"))
    assert r["diff"] < 1e-4  # Adam's eps 1e-4 as above: a wrong step is off by O(lr)
