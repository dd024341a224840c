"""meshtron starts the CUDA allocator with expandable segments unless the user chose a setting."""

import subprocess
import sys

import pytest
import torch

from meshtron.allocator import EXPANDABLE_SEGMENTS, default_to_expandable_segments


def test_expandable_segments_when_nothing_is_set():
    env = {"PATH": "/bin"}
    assert default_to_expandable_segments(env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == EXPANDABLE_SEGMENTS


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_a_users_setting_is_kept(name):
    env = {name: "expandable_segments:False"}
    assert not default_to_expandable_segments(env)
    assert env == {name: "expandable_segments:False"}


def test_nothing_is_set_once_cuda_is_in_use(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    env = {}
    assert not default_to_expandable_segments(env)
    assert env == {}


def test_the_command_sets_it_for_its_workers(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    code = ("import os; from meshtron.cli import main; main(['presets']); "
            "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == EXPANDABLE_SEGMENTS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_allocator_reads_the_setting_made_after_importing_torch(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    # torch is imported before meshtron's entry point runs (as under torchrun -m meshtron); the allocator must
    # still take the setting, which it reads when CUDA is first used.
    code = ("import torch; from meshtron.allocator import default_to_expandable_segments as d; d(); "
            "x = torch.empty(1 << 26, device='cuda'); "
            "print(all(s.get('is_expandable') for s in torch.cuda.memory_snapshot()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "True"
