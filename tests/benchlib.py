"""What the benchmark files (tests/bench_*.py) and the tiny-model tests share: one torch thread for a module, a
SmolLM2-135M-shaped Llama."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module, restored after: benchmark ratios are thread CPU times, and on a shared 2-core
    machine oversubscribed OpenMP threads made tiny-model tests 5-10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def smollm2_shaped():
    """A Llama with SmolLM2-135M's shapes (49,152-token vocabulary, 30 layers) and seeded random weights: costs
    depend on the shapes only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49_152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)
