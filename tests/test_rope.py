"""Rope's scalings (``dist_kernels.models.rope``): the frequencies and attention factor of
linear, llama3 and yarn against transformers' own ``ROPE_INIT_FUNCTIONS`` (its FP32 against our
FP64), the checks on a ``rope_scaling`` dict, and what the scaling does to a model: rope's
relative-position property holds, and a scaled model attends as the unscaled one at positions
divided by the factor (linear)."""

import json
import math

import pytest
import torch

from dist_kernels.models import GPT, GPTConfig
from dist_kernels.models.rope import rope_frequencies, rope_scaling_checked, rope_tables

SEED = 20261206

# Each kind in settings that reach every branch: llama3 at a trained length of 64 puts the
# 8-wide heads' 4 pairs (wavelengths 6.3, 63, 628, 6283 at theta 1e4) in all three bands
# (kept, blended, divided); yarn's ramps at 4096 cover kept, ramped and divided pairs
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "llama3-release": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn-betas-untruncated": {"rope_type": "yarn", "factor": 16.0, "beta_fast": 16.0,
                               "beta_slow": 2.0, "truncate": False,
                               "original_max_position_embeddings": 2048},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.5,
                              "original_max_position_embeddings": 512},
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("head_dim,theta", [(8, 1e4), (64, 5e5), (128, 1e6)])
def test_frequencies_match_transformers(name, head_dim, theta):
    """Ours (FP64) against transformers' (FP32): within FP32's rounding, and the same
    attention factor; a wrong band, ramp or factor is off by far more."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = rope_scaling_checked(CASES[name])
    hf = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=1 << 16,
        rope_parameters={"rope_theta": theta, **scaling},
    )  # fmt: skip
    theirs, their_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    ours, our_factor = rope_frequencies(head_dim, theta, scaling)
    plain, _ = rope_frequencies(head_dim, theta)
    assert ours.dtype == torch.float64 and ours.shape == (head_dim // 2,)
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(their_factor, rel=1e-12)
    assert not torch.allclose(ours, plain)  # the scaling changed something
    assert torch.all(ours <= plain * (1 + 1e-12))  # every scaling slows the turns, none speeds


@pytest.mark.parametrize("length", [None, 4096, 4097, 131072])
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_frequencies_match_transformers(length, partial):
    """LongRoPE (Phi-4-mini's form: 0.75 of a 128-wide head, trained on 4,096 positions, run
    to 131,072): the short factors up to the trained length, the long ones beyond, and the
    attention factor, against transformers' ``_compute_longrope_parameters``."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary = int(128 * partial)
    gen = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    short = (1 + torch.rand(rotary // 2, generator=gen, dtype=torch.float64)).tolist()
    long = (1 + 40 * torch.rand(rotary // 2, generator=gen, dtype=torch.float64)).tolist()
    given = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
             "original_max_position_embeddings": 4096}  # fmt: skip
    hf = transformers.Phi3Config(
        hidden_size=128 * 4, num_attention_heads=4, max_position_embeddings=131072,
        original_max_position_embeddings=4096, pad_token_id=None,
        rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": partial, **given},
    )  # fmt: skip
    theirs, their_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=length)
    scaling = rope_scaling_checked({**given, "factor": 131072 / 4096})
    ours, our_factor = rope_frequencies(rotary, 1e4, scaling, length)
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(their_factor, rel=1e-12)
    assert our_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-12)
    plain, _ = rope_frequencies(rotary, 1e4)
    used = long if length is not None and length > 4096 else short
    torch.testing.assert_close(ours, plain / torch.tensor(used, dtype=torch.float64))


def test_llama3_bands_against_float64_formula():
    """Llama 3.1's three bands, each by its rule, in float64 written out here."""
    s = rope_scaling_checked(CASES["llama3"])
    freq, _ = rope_frequencies(8, 1e4, s)
    plain = [1e4 ** (-2 * i / 8) for i in range(4)]
    want = []
    for f in plain:
        wavelength = 2 * math.pi / f
        if wavelength < 64 / 4.0:
            want.append(f)
        elif wavelength > 64 / 1.0:
            want.append(f / 8.0)
        else:
            w = (64 / wavelength - 1.0) / (4.0 - 1.0)
            want.append((1 - w) * f / 8.0 + w * f)
    torch.testing.assert_close(freq, torch.tensor(want, dtype=torch.float64), rtol=1e-15, atol=0)
    assert freq[0] == plain[0] and freq[3] == plain[3] / 8.0  # kept, divided
    assert plain[1] / 8.0 < freq[1] < plain[1]  # blended


def test_rope_scaling_dicts_are_completed_and_checked():
    full = rope_scaling_checked(
        {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4096.0}
    )
    assert full == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                    "beta_fast": 32.0, "beta_slow": 1.0,
                    "attention_factor": pytest.approx(0.1 * math.log(4.0) + 1),
                    "truncate": True}  # fmt: skip
    assert rope_scaling_checked(full) == full  # idempotent
    assert rope_scaling_checked(json.loads(json.dumps(full))) == full  # a checkpoint's record
    config = GPTConfig(position_embedding="rope", rope_scaling={"rope_type": "llama3", "factor": 8})
    assert config.rope_scaling["original_max_position_embeddings"] == 8192  # Llama 3.1's
    bad = [
        ({"rope_type": "dynamic", "factor": 2.0},
         r"rope_type is one of \('linear', 'llama3', 'yarn', 'longrope'\)"),
        ({"rope_type": "linear"}, r"'linear': factor is required"),
        ({"rope_type": "linear", "factor": 0}, r"factor must be a positive number, got 0"),
        ({"rope_type": "yarn", "factor": 4.0}, r"original_max_position_embeddings is required"),
        ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1},
         r"low_freq_factor\(4.0\) must be below high_freq_factor\(1.0\)"),
        ({"rope_type": "linear", "factor": 2, "beta_fast": 3}, r"unknown keys \['beta_fast'\]"),
        ({"rope_type": "llama3", "factor": 8, "original_max_position_embeddings": 1.5},
         r"original_max_position_embeddings must be a positive int, got 1.5"),
    ]  # fmt: skip
    for scaling, message in bad:
        with pytest.raises(ValueError, match="GPTConfig: rope_scaling.*" + message):
            GPTConfig(position_embedding="rope", rope_scaling=scaling)
    with pytest.raises(ValueError, match=r"rope_scaling needs position_embedding='rope'"):
        GPTConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match=r"the head size 5 \(kv_channels\) is odd"):
        GPTConfig(position_embedding="rope", kv_channels=5)
    with pytest.raises(ValueError, match=r"head size 8 \(dim\(32\) / n_heads\(4\)\) x "
                       r"rotary_percent\(0.375\) = 3 is odd"):  # fmt: skip
        GPTConfig(position_embedding="rope", dim=32, n_heads=4, rotary_percent=0.375)
    with pytest.raises(ValueError, match=r"rotary_percent must lie in \(0, 1\], got 1.5"):
        GPTConfig(position_embedding="rope", rotary_percent=1.5)
    with pytest.raises(ValueError, match=r"rotary_percent\(0.5\) needs position_embedding"):
        GPTConfig(rotary_percent=0.5)


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn"])
def test_scaled_rope_still_depends_on_relative_position_only(name):
    """q.k after rope depends on the positions' difference alone, scaled or not; yarn's
    attention factor multiplies every score by its square."""
    from dist_kernels.models.gpt import apply_rope

    scaling = rope_scaling_checked(CASES[name])
    g = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    q, k = (
        torch.randn(16, generator=g, dtype=torch.float64),
        torch.randn(16, generator=g, dtype=torch.float64),
    )
    cos, sin = rope_tables(torch.arange(200), 16, 500.0, scaling)
    plain_cos, plain_sin = rope_tables(torch.arange(200), 16, 500.0)

    def score(p, p2, c, s):
        return float(apply_rope(q, c[p], s[p]) @ apply_rope(k, c[p2], s[p2]))

    factor = rope_frequencies(16, 500.0, scaling)[1]
    for p, p2 in ((3, 0), (50, 47), (190, 187)):
        assert score(p, p2, cos, sin) == pytest.approx(score(3, 0, cos, sin), rel=1e-10)
    assert score(3, 0, cos, sin) != pytest.approx(score(3, 0, plain_cos, plain_sin), rel=1e-6)
    assert score(0, 0, cos, sin) == pytest.approx(factor**2 * float(q @ k), rel=1e-12)


def test_linear_scaling_is_the_unscaled_model_at_divided_positions(monkeypatch):
    """A whole model with linear scaling by 2 gives the unscaled model's logits when the
    unscaled model is fed the positions halved: rope is the only thing that changed."""
    import dist_kernels.models.gpt as gpt_module

    torch.manual_seed(SEED)
    print(f"seed {SEED}")
    base = dict(n_layers=2, n_heads=4, dim=32, vocab_size=64, block_size=16, bias=False,
                normalization="rmsnorm", swiglu=True, position_embedding="rope")  # fmt: skip
    scaled = GPT(GPTConfig(**base, rope_scaling={"rope_type": "linear", "factor": 2.0})).double()
    plain = GPT(GPTConfig(**base)).double().eval()
    plain.load_state_dict(scaled.state_dict())
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        want, unscaled = scaled.eval()(ids), plain(ids)
        calls = []

        def tables_at_half(pos, head_dim, theta, scaling=None, length=None):
            calls.append(scaling)
            return rope_tables(pos.to(torch.float64) / 2, head_dim, theta, scaling)

        monkeypatch.setattr(gpt_module, "rope_tables", tables_at_half)
        got = plain(ids)
    assert calls == [None, None]  # each block's attention, unscaled
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert not torch.allclose(unscaled, want)
