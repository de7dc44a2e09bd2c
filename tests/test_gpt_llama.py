"""The GPT's Llama-style options (RMSNorm, SwiGLU, rotary position embedding) against float64
references written from their definitions, not from the model's code.

The layouts (tp, sequence parallelism, cp with zig-zag shards, the driver's dp / pp) are
checked against one process in tests/test_gpt_tp.py, tests/test_gpt_cp.py and
tests/test_train.py.
"""

import math

import pytest
import torch

from dist_kernels.models import GPT, GPTConfig
from dist_kernels.models.gpt import Block, apply_rope, rope_tables

SEED = 20261205
LLAMA = dict(normalization="rmsnorm", swiglu=True, position_embedding="rope")


def _rope_reference(x, pos, theta):
    """Each pair (x[i], x[i + d/2]) read as the complex number x[i] + j x[i + d/2] and
    multiplied by exp(j pos theta^(-2i/d)) (Su et al. 2021, section 3.2, halves layout)."""
    d = x.shape[-1]
    half = d // 2
    z = torch.complex(x[..., :half], x[..., half:])
    freq = torch.tensor([theta ** (-2 * i / d) for i in range(half)], dtype=torch.float64)
    turned = z * torch.polar(torch.ones(len(pos), half, dtype=torch.float64), pos[:, None] * freq)
    return torch.cat([turned.real, turned.imag], dim=-1)


def test_rope_turns_each_pair_by_its_positions_angle():
    print("seed", SEED)
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(2, 3, 7, 8, generator=gen, dtype=torch.float64)  # [b, heads, s, d]
    pos = torch.tensor([0, 1, 2, 5, 6, 30, 31])  # zig-zag shards hold positions like these
    cos, sin = rope_tables(pos, 8, 10000.0)
    want = _rope_reference(x, pos.double(), 10000.0)
    torch.testing.assert_close(apply_rope(x, cos, sin), want, rtol=0, atol=1e-12)
    got = apply_rope(x.float(), cos, sin)  # FP32 in, FP32 out
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_rope_scores_depend_on_the_distance_only():
    """The property rotary embeddings are built for: q at p and k at p' score as q at p + t and
    k at p' + t."""
    gen = torch.Generator().manual_seed(SEED + 1)
    q, k = torch.randn(2, 16, generator=gen)
    cos, sin = rope_tables(torch.arange(64), 16, 500.0)

    def score(p, p2):
        return float(apply_rope(q, cos[p], sin[p]) @ apply_rope(k, cos[p2], sin[p2]))

    assert score(3, 10) == pytest.approx(score(40, 47), rel=1e-5)
    assert score(3, 10) != pytest.approx(score(3, 11), rel=1e-3)  # and the distance does matter


def _rmsnorm(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _block_reference(block, x, cfg):
    """One pre-norm Llama block on ``x [s, b, h]`` in float64 from its definition, with the
    block's weights: causal softmax attention on rotated q and k, SwiGLU MLP, RMSNorm."""
    s, b, h = x.shape
    heads, groups, d = cfg.n_heads, cfg.kv_heads, cfg.dim // cfg.n_heads
    r = heads // groups  # query heads per key / value head
    a = _rmsnorm(x, block.ln_1.weight, cfg.norm_eps)
    qkv = a @ block.attn.qkv.weight.t() + block.attn.qkv.bias
    qkv = qkv.view(s, b, groups, r + 2, d)  # group by group: its r queries, its key, its value
    pos = torch.arange(s, dtype=torch.float64)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    outs = []
    for head in range(heads):  # query head `head` attends with its group's key and value
        g = head // r
        q = _rope_reference(qkv[:, :, g, head % r].transpose(0, 1), pos, cfg.rope_theta)
        k = _rope_reference(qkv[:, :, g, r].transpose(0, 1), pos, cfg.rope_theta)  # [b, s, d]
        v = qkv[:, :, g, r + 1].transpose(0, 1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(mask, float("-inf"))
        outs.append(scores.softmax(-1) @ v)  # [b, s, d]
    y = torch.stack(outs, dim=2).permute(1, 0, 2, 3).reshape(s, b, h)  # heads in order
    x = x + y @ block.attn.proj.weight.t() + block.attn.proj.bias
    m = _rmsnorm(x, block.ln_2.weight, cfg.norm_eps)
    mlp = block.mlp
    gate = m @ mlp.gate.weight.t() + mlp.gate.bias
    up = m @ mlp.fc.weight.t() + mlp.fc.bias
    hidden = gate * torch.sigmoid(gate) * up  # silu(gate) * up
    return x + hidden @ mlp.proj.weight.t() + mlp.proj.bias


@pytest.mark.parametrize("kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
def test_llama_block_equals_its_definition(kv_heads):
    """Multi-head, grouped-query (2 query heads per key / value head) and multi-query
    attention."""
    print("seed", SEED)
    torch.manual_seed(SEED)
    cfg = GPTConfig(
        dim=32, n_heads=4, n_kv_heads=kv_heads, block_size=16, rope_theta=1000.0, **LLAMA
    )
    block = Block(cfg).double()
    for p in block.parameters():  # non-trivial norm weights and biases too
        torch.nn.init.normal_(p, std=0.3)
    assert isinstance(block.ln_1, torch.nn.RMSNorm) and block.mlp.gate is not None
    x = torch.randn(9, 2, 32, dtype=torch.float64)
    torch.testing.assert_close(block(x), _block_reference(block, x, cfg), rtol=1e-12, atol=1e-12)


def test_grouped_heads_shrink_qkv_and_tp_needs_whole_groups():
    cfg = GPTConfig(dim=32, n_heads=4, n_kv_heads=2)
    assert GPT(cfg).blocks[0].attn.qkv.weight.shape == ((4 + 2 * 2) * 8, 32)
    with pytest.raises(ValueError, match=r"GPT: n_kv_heads\(2\) % tp\(4\) != 0"):
        GPT(cfg).tp_plan(4)


def test_rope_model_has_no_position_table_and_gpt2_model_is_unchanged():
    torch.manual_seed(SEED)
    llama = GPT(GPTConfig(**LLAMA))
    assert llama.embedding.wpe is None
    names = [n for n, _ in llama.named_parameters()]
    assert not any("wpe" in n for n in names)
    assert [n for n in names if "ln_" in n] == ["blocks.0.ln_1.weight", "blocks.0.ln_2.weight",
        "blocks.1.ln_1.weight", "blocks.1.ln_2.weight", "head.ln_f.weight"]  # fmt: skip
    gpt2 = GPT(GPTConfig())
    assert gpt2.embedding.wpe is not None and gpt2.blocks[0].mlp.gate is None
    assert isinstance(gpt2.blocks[0].ln_1, torch.nn.LayerNorm)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(normalization="batchnorm"),
         r"normalization must be one of \('layernorm', 'rmsnorm'\)"),
        (dict(position_embedding="alibi"),
         r"position_embedding must be one of \('learned', 'rope'\)"),
        (dict(position_embedding="rope", dim=36, n_heads=4),
         r"head size 9 \(dim\(36\) / n_heads\(4\)\) is odd"),
        (dict(n_heads=4, n_kv_heads=3),
         r"n_kv_heads\(3\) must be a positive divisor of n_heads\(4\)"),
    ],
)  # fmt: skip
def test_bad_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_sliding_window_sees_only_its_window():
    """One block with rope and a window of 5 (Mistral's ``sliding_window``): the logits at
    position i are those of the window's tokens ``ids[i - 4 : i + 1]`` run alone (rope's
    scores depend on relative positions only), and not those of the whole prefix; a window
    as long as the sequence is the plain causal model, bit for bit."""
    torch.manual_seed(SEED)
    print("seed", SEED)
    base = dict(n_layers=1, n_heads=4, n_kv_heads=2, dim=32, vocab_size=40, block_size=16,
                bias=False, **LLAMA)  # fmt: skip
    windowed = GPT(GPTConfig(**base, sliding_window=5)).double().eval()
    ids = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        logits = windowed(ids)
        for i in range(16):
            alone = windowed(ids[:, max(0, i - 4) : i + 1])[:, -1]
            torch.testing.assert_close(logits[:, i], alone, rtol=0, atol=1e-12)
        plain = GPT(GPTConfig(**base)).double().eval()
        plain.load_state_dict(windowed.state_dict())
        assert (plain(ids)[:, 5:] - logits[:, 5:]).abs().min() > 0  # the prefix mattered there
        torch.testing.assert_close(plain(ids)[:, :5], logits[:, :5], rtol=0, atol=1e-12)
        whole = GPT(GPTConfig(**base, sliding_window=16)).double().eval()
        whole.load_state_dict(windowed.state_dict())
        assert torch.equal(whole(ids), plain(ids))
    with pytest.raises(ValueError, match=r"sliding_window must be a positive int, got 0"):
        GPTConfig(**base, sliding_window=0)
