"""Named model shapes. Real published shapes except `tiny`, which is sized to train in minutes on a CPU.

Sources: GPT-2 (Radford et al. 2019, table 2), Llama 3.2 1B and Llama 3.1 8B/70B (Meta model cards),
Mixtral 8x7B (Jiang et al. 2024, table 1 and its config.json), Switch-Base-8 (Fedus et al. 2021, table 9:
T5-Base's width with 8 experts in every other feed-forward layer; ours is decoder-only, GELU, 12 blocks,
where the paper's is an encoder-decoder with 12 + 12). `moe-tiny` is `tiny` with 8 top-2 experts of half
its MLP width, so its active parameters per token equal tiny's.
Any key given next to `model.preset` overrides the preset's value (`model.moe` key by key), and a
preset's value that belongs to a choice the user changed gives way (`give_way`).
"""

_GPT2 = dict(arch="gpt2", vocab_size=50257, seq_len=1024, tie_embeddings=True, bias=True, norm_eps=1e-5)
_LLAMA3 = dict(arch="llama", vocab_size=128256, rope_theta=500000.0, bias=False, norm_eps=1e-5)

PRESETS: dict[str, dict] = {
    "tiny": dict(arch="llama", n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, d_ff=384,
                 vocab_size=4096, seq_len=128, tie_embeddings=False),
    "gpt2-124m": dict(_GPT2, n_layers=12, d_model=768, n_heads=12),
    "gpt2-350m": dict(_GPT2, n_layers=24, d_model=1024, n_heads=16),
    "gpt2-774m": dict(_GPT2, n_layers=36, d_model=1280, n_heads=20),
    "gpt2-1.5b": dict(_GPT2, n_layers=48, d_model=1600, n_heads=25),
    "llama-1b": dict(_LLAMA3, n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, d_ff=8192,
                     seq_len=2048, tie_embeddings=True),
    "llama-8b": dict(_LLAMA3, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                     seq_len=8192, tie_embeddings=False),
    "llama-70b": dict(_LLAMA3, n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                      seq_len=8192, tie_embeddings=False),
    "moe-tiny": dict(arch="llama", n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, d_ff=192,
                     vocab_size=4096, seq_len=128, tie_embeddings=False,
                     moe=dict(num_experts=8, top_k=2, router="softmax-topk")),
    "switch-base-8": dict(arch="gpt2", n_layers=12, d_model=768, n_heads=12, d_ff=3072, vocab_size=32128,
                          seq_len=512, bias=False, tie_embeddings=True,
                          moe=dict(num_experts=8, router="switch-top1", capacity_factor=1.25, every=2)),
    "mixtral-8x7b": dict(arch="llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                         vocab_size=32000, seq_len=32768, rope_theta=1e6, bias=False, norm_eps=1e-5,
                         tie_embeddings=False, moe=dict(num_experts=8, top_k=2, router="softmax-topk")),
}

# The preset's settings of a router: another model.moe.router takes its own defaults for them.
ROUTER_KEYS = ("top_k", "capacity_factor", "groups", "noise")


def give_way(preset: dict, given: dict) -> dict:
    """The preset's keys that stand, given the user's `given` model keys: keys the user set replace the
    preset's (the caller merges them), and these preset keys are dropped (their defaults apply) so that
    a preset never contradicts an explicit choice:
    - model.moe.top_k, capacity_factor, groups, noise when the user chose another model.moe.router
      (they were the preset router's settings: moe-tiny's top_k=2 is not switch-top1's 1);
    - model.n_kv_heads when it does not divide the user's model.n_heads (grouped heads then off)."""
    out = dict(preset)
    moe, mine = preset.get("moe"), given.get("moe")
    if isinstance(moe, dict) and isinstance(mine, dict) and mine.get("router", moe.get("router")) != moe.get("router"):
        out["moe"] = {k: v for k, v in moe.items() if k not in ROUTER_KEYS}
    kv, heads = preset.get("n_kv_heads"), given.get("n_heads")
    if kv and isinstance(heads, int) and heads > 0 and "n_kv_heads" not in given and heads % kv:
        out.pop("n_kv_heads")
    return out
