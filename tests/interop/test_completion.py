"""Greedy text from llama-completion through the worker must equal llama.cpp's own CPU backend, byte for byte."""
from __future__ import annotations

import pytest

from .conftest import CLIENT_THREADS, CPU_TIMEOUT, RPC_TIMEOUT, assert_fully_offloaded, text_diff

pytestmark = pytest.mark.interop

N_PREDICT = 64

PROMPTS = {
    "fact": "The capital of France is",
    "list": "Here are three simple tips for staying healthy:\n1.",
    # ~190 tokens: with -b/-ub 64 the prompt is processed in several batches, so the worker
    # sees KV-cache writes at non-zero offsets and attention over earlier batches.
    "long": (
        "The old lighthouse stood at the end of a narrow spit of land, where the river met the sea and "
        "the tides argued twice a day about which of them owned the shore. For ninety years a keeper had "
        "climbed its spiral stairs each evening to light the lamp, trim the wick, and write a line in the "
        "logbook about the weather, the ships that passed, and anything else that seemed worth remembering. "
        "The entries were short and plain: fog until noon, a schooner bound south, gulls unusually loud, "
        "the cat has caught another mouse. When the light was finally automated, the last keeper packed the "
        "logbooks into a wooden crate and carried them to the town library, where they sat unread on a low "
        "shelf for decades. Then one winter a schoolteacher opened the first volume, started reading aloud "
        "to her class, and discovered that the dull little notes, taken together, told the story of the "
        "whole coast. Her students decided to"
    ),
}


def completion_args(model_path, prompt: str, flash_attn: str) -> list[str]:
    """Everything except the device placement; -fit off so the client never trims the offload."""
    return [
        "-m", model_path, "-p", prompt, "-n", N_PREDICT, "--ignore-eos", "--temp", "0", "-s", "1",
        "-no-cnv", "--no-display-prompt", "-t", CLIENT_THREADS, "-c", 512, "-b", 64, "-ub", 64,
        "-fa", flash_attn, "-fit", "off", "-lv", 4,
    ]


@pytest.fixture(scope="session")
def cpu_completion(llama, model_path):
    """Baseline text from the CPU backend, computed at most once per (prompt, flash-attn) per session."""
    cache: dict[tuple[str, str], str] = {}

    def baseline(prompt_id: str, flash_attn: str) -> str:
        key = (prompt_id, flash_attn)
        if key not in cache:
            args = completion_args(model_path, PROMPTS[prompt_id], flash_attn) + ["-ngl", 0]
            cache[key] = llama("llama-completion", args, timeout=CPU_TIMEOUT).stdout
        return cache[key]

    return baseline


@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("prompt_id", list(PROMPTS))
def test_completion_matches_cpu(llama, model_path, worker, cpu_completion, prompt_id, flash_attn):
    expected = cpu_completion(prompt_id, flash_attn)
    assert expected.strip(), "the CPU baseline produced no text"

    args = completion_args(model_path, PROMPTS[prompt_id], flash_attn) + ["--rpc", worker.address, "-ngl", 99]
    done = llama("llama-completion", args, timeout=RPC_TIMEOUT, worker=worker)
    assert_fully_offloaded(done.stderr)
    assert done.stdout == expected, text_diff(expected, done.stdout)
