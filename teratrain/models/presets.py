"""Named model shapes. Real published shapes except `tiny`, which is sized to train in minutes on a CPU.

Sources: GPT-2 (Radford et al. 2019, table 2), Llama 3.2 1B and Llama 3.1 8B/70B (Meta model cards).
Any key given next to `model.preset` overrides the preset's value.
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
}
