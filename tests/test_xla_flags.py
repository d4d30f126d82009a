"""The portable CPU numerics flags: added once, never over a flag the user set, switchable off;
the compilation cache: on by default, in the user's cache folder unless the user names one."""

import os

from joyagents_jax import xla_flags


def test_flags_are_added_to_what_the_user_set():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    xla_flags.pin_cpu_numerics(env)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8",
                                        *xla_flags.PORTABLE]
    xla_flags.pin_cpu_numerics(env)  # idempotent
    assert env["XLA_FLAGS"].split().count("--xla_cpu_max_isa=AVX2") == 1


def test_a_users_own_value_wins_and_the_switch_turns_it_off():
    env = {"XLA_FLAGS": "--xla_cpu_max_isa=AVX512"}
    xla_flags.pin_cpu_numerics(env)
    assert env["XLA_FLAGS"].split() == ["--xla_cpu_max_isa=AVX512",
                                        "--xla_cpu_experimental_ynn_fusion_type="]
    env = {xla_flags.SWITCH: "0"}
    xla_flags.pin_cpu_numerics(env)
    assert "XLA_FLAGS" not in env


def test_the_compilation_cache_defaults_to_the_users_cache_folder(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    xla_flags.use_compilation_cache(env)
    assert env[xla_flags.CACHE_DIR] == str(tmp_path / "joyagents" / "xla")
    assert os.path.isdir(env[xla_flags.CACHE_DIR])
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0.2"
    assert xla_flags.default_cache_dir({}) == os.path.join(os.path.expanduser("~"), ".cache",
                                                          "joyagents", "xla")


def test_a_users_cache_setting_wins_and_an_empty_one_turns_it_off(tmp_path):
    env = {xla_flags.CACHE_DIR: "", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "5"}
    xla_flags.use_compilation_cache(env)
    assert env == {xla_flags.CACHE_DIR: "", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "5"}
    env = {xla_flags.CACHE_DIR: str(tmp_path / "mine")}
    xla_flags.use_compilation_cache(env)
    assert env[xla_flags.CACHE_DIR] == str(tmp_path / "mine")


def test_an_unwritable_cache_folder_is_reported_once_and_turned_off(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    env = {xla_flags.CACHE_DIR: str(tmp_path / "a_file" / "xla")}
    xla_flags.use_compilation_cache(env)
    assert env[xla_flags.CACHE_DIR] == ""
    assert "cannot create or write the compilation cache folder" in capsys.readouterr().err
    env = {xla_flags.CACHE_DIR: "gs://bucket/xla"}  # remote stores are JAX's to open
    xla_flags.use_compilation_cache(env)
    assert env[xla_flags.CACHE_DIR] == "gs://bucket/xla"
