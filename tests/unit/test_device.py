"""Facts about the accelerator environment that bigtrain repairs or decides from."""
import pytest

from bigtrain.distributed.device import deepspeed_arch_list, fix_cuda_arch_list


@pytest.mark.parametrize("value, fixed", [
    ("9.0a", "9.0"),  # NVIDIA's CUDA images (seen on the H100 this project measured on)
    ("8.0;9.0a", "8.0;9.0"),
    ("9.0a 10.0a+PTX", "9.0;10.0+PTX"),
    ("9.0a;9.0", "9.0"),
    ("9.0", None), ("8.6;9.0+PTX", None), ("", None),
])
def test_arch_suffixes_deepspeed_cannot_parse_are_dropped(value, fixed):
    assert deepspeed_arch_list(value) == fixed


def test_the_launcher_environment_and_a_rank_get_a_readable_arch_list(monkeypatch):
    from bigtrain.launch.train import thread_env
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert thread_env(1)["TORCH_CUDA_ARCH_LIST"] == "9.0"
    env = {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    assert "'9.0a' -> '9.0'" in fix_cuda_arch_list(env) and env == {"TORCH_CUDA_ARCH_LIST": "9.0"}
    assert fix_cuda_arch_list(env) is None and fix_cuda_arch_list({}) is None


def test_only_bigtrain_s_own_value_errors_read_as_a_users_mistake():
    from bigtrain.ds.lint import LintError
    from bigtrain.train.process import users_mistake
    from bigtrain.models import build

    def caught(fn):
        try:
            fn()
        except ValueError as err:
            return err
        raise AssertionError("no ValueError")

    assert users_mistake(caught(lambda: build("gpt2", "tiny", vocab_multiple=0)))
    assert not users_mistake(caught(lambda: int("0a")))  # the arch-list failure inside DeepSpeed looked like this
    assert users_mistake(LintError(["zero_optimization.stage=5: use 0-3"]))


def test_a_cpu_only_install_is_known_without_importing_torch_and_agrees_with_deepspeed(tmp_path, monkeypatch):
    """`bigtrain train` tells its launcher and ranks the accelerator (DS_ACCELERATOR, so none of them warns about
    its own detection); on a CPU-only install it knows it from the files, without importing DeepSpeed and torch."""
    import importlib.util
    import os
    import subprocess
    import sys

    from bigtrain.distributed import device
    probe = ("import sys; from bigtrain.distributed.device import accelerator_name; "
             "print(accelerator_name(), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    said = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True).stdout
    from deepspeed.accelerator import get_accelerator
    assert said.split() == ([get_accelerator().device_name(), "False"] if device.cpu_only_install() else
                            [get_accelerator().device_name(), "True"])
    # a CUDA build of torch, or another accelerator's package, leaves the detection to DeepSpeed
    lib = tmp_path / "torch" / "lib"
    lib.mkdir(parents=True)
    (lib / "libtorch_cpu.so").write_bytes(b"")
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "torch":
            return _package_spec(tmp_path / "torch")
        return None if name in device.ACCELERATOR_PACKAGES else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert device.cpu_only_install()
    (lib / "libtorch_cuda.so").write_bytes(b"")
    assert not device.cpu_only_install()
    (lib / "libtorch_cuda.so").unlink()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    assert not device.cpu_only_install()


def _package_spec(path):
    import importlib.machinery
    spec = importlib.machinery.ModuleSpec(path.name, None, is_package=True)
    spec.submodule_search_locations = [str(path)]
    return spec
