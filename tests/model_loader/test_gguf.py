"""GGUF loading on small synthetic files: config, names, llama.cpp's Q/K permutation
undone, every supported quantization, the conversion cache, and clear errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from sglite.model_loader import ModelLoadError, load_model  # noqa: E402
from sglite.model_loader.gguf import unpermute_qk  # noqa: E402

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 256, 4, 2, 512, 1, 260
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q_proj / k_proj rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    w = {"model.embed_tokens.weight": rng.randn(VOCAB, HIDDEN), "model.norm.weight": rng.randn(HIDDEN),
         "lm_head.weight": rng.randn(VOCAB, HIDDEN)}
    p = "model.layers.0."
    w[p + "self_attn.q_proj.weight"] = rng.randn(HIDDEN, HIDDEN)
    w[p + "self_attn.k_proj.weight"] = rng.randn(KV_HEADS * HEAD_DIM, HIDDEN)
    w[p + "self_attn.v_proj.weight"] = rng.randn(KV_HEADS * HEAD_DIM, HIDDEN)
    w[p + "self_attn.o_proj.weight"] = rng.randn(HIDDEN, HIDDEN)
    w[p + "mlp.gate_proj.weight"] = rng.randn(FFN, HIDDEN)
    w[p + "mlp.up_proj.weight"] = rng.randn(FFN, HIDDEN)
    w[p + "mlp.down_proj.weight"] = rng.randn(HIDDEN, FFN)
    w[p + "input_layernorm.weight"] = rng.randn(HIDDEN)
    w[p + "post_attention_layernorm.weight"] = rng.randn(HIDDEN)
    return {k: v.astype(np.float32) for k, v in w.items()}


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
}


def random_k_blocks(rows: int, cols: int, qtype, seed: int = 0) -> np.ndarray:
    """Valid-looking K-quant blocks (gguf cannot quantize to K types): random bytes
    with sane fp16 scales."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.RandomState(seed).randint(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == Q.Q6_K:
        raw[..., -2:] = scale  # d is the block's last field
    else:  # Q4_K: d and dmin first
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    return raw.reshape(rows, -1)


def write_gguf(path, weights=None, arch="llama", qtypes=None, tensors_raw=None) -> dict:
    """A tiny llama GGUF; returns what each HF tensor should dequantize to."""
    weights = weights or hf_weights()
    qtypes = qtypes or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    w.add_vocab_size(VOCAB)
    from sglite.model_loader.tokenizer import bytes_to_unicode

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"] + list(bytes_to_unicode().values())
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3, 3] + [1] * 256)
    w.add_token_merges([])
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    expected = {}
    for name, arr in weights.items():
        gname = GGUF_NAMES[name]
        if name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, HEADS)
        elif name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, KV_HEADS)
        qt = qtypes.get(name, Q.F32)
        if qt in (Q.Q4_K, Q.Q6_K):
            data = random_k_blocks(*arr.shape, qt)
        else:
            data = gguf.quants.quantize(arr, qt)
        deq = gguf.quants.dequantize(data, qt).reshape(arr.shape)
        if name.endswith("q_proj.weight"):
            deq = unpermute_qk(torch.from_numpy(deq), HEADS).numpy()
        elif name.endswith("k_proj.weight"):
            deq = unpermute_qk(torch.from_numpy(deq), KV_HEADS).numpy()
        expected[name] = deq
        if qt in (Q.F32, Q.F16):
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qt)
    for gname, data, qt in tensors_raw or []:
        w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLITE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_config_names_and_unpermuted_qk(tmp_path):
    path = tmp_path / "m.gguf"
    src = hf_weights()
    write_gguf(path, src)
    m = load_model(str(path))
    c = m.config
    assert (c.architecture, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        "llama", HIDDEN, HEADS, KV_HEADS, HEAD_DIM)
    assert (c.intermediate_size, c.num_hidden_layers, c.vocab_size, c.rope_theta) == (FFN, LAYERS, VOCAB, 50000.0)
    assert not c.tie_word_embeddings and c.eos_token_ids == [2]
    assert set(m.weights) == set(src)
    for name, arr in src.items():
        assert torch.equal(m.weights[name], torch.from_numpy(arr)), name  # F32: exact, permutation undone


def test_unpermute_inverts_llama_cpp():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    back = unpermute_qk(torch.from_numpy(llama_cpp_permute(w, 3)), 3)
    assert torch.equal(back, torch.from_numpy(w))


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_each_quantization_dequantizes(tmp_path, qtype):
    path = tmp_path / f"{qtype}.gguf"
    qt = Q[qtype]
    targets = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
               "model.layers.0.mlp.down_proj.weight"]
    expected = write_gguf(path, qtypes={t: qt for t in targets})
    m = load_model(str(path))
    src = hf_weights()
    for t in targets:
        got = m.weights[t]
        assert got.dtype == torch.float32 and got.shape == torch.Size(src[t].shape)
        assert torch.equal(got, torch.from_numpy(expected[t])), t
        if qtype not in ("Q4_K", "Q6_K"):  # the others were quantized from src
            tol = {"F16": 2e-3, "BF16": 3e-2, "Q8_0": 5e-2, "Q4_0": 0.8, "Q4_1": 0.5}[qtype]
            assert (got - torch.from_numpy(src[t])).abs().max().item() < tol


def test_second_load_hits_the_conversion_cache(tmp_path, capsys, cache_dir):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    first = load_model(str(path))
    assert "converting" in capsys.readouterr().err
    second = load_model(str(path))
    assert "converting" not in capsys.readouterr().err
    assert all(torch.equal(first.weights[k], second.weights[k]) for k in first.weights)
    assert second.tokenizer.encode("hi <|im_end|>") == first.tokenizer.encode("hi <|im_end|>")
    assert len(list((cache_dir / "converted").iterdir())) == 1


def test_missing_garbage_and_truncated_files(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file|not a file"):
        load_model(str(tmp_path / "nope.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"hello, not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(junk))
    good = tmp_path / "good.gguf"
    write_gguf(good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_model(str(cut))


def test_unsupported_architecture_and_quant(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load_model(str(path))
    path = tmp_path / "q2k.gguf"
    block, size = gguf.GGML_QUANT_SIZES[Q.Q2_K]
    raw = np.zeros((4, HIDDEN // block * size), dtype=np.uint8)
    write_gguf(path, tensors_raw=[("blk.0.attn_q_extra.weight", raw, Q.Q2_K)])
    # unknown extra tensor names are skipped; a known one in Q2_K is refused
    path2 = tmp_path / "q2k2.gguf"
    weights = hf_weights()
    weights.pop("model.layers.0.self_attn.v_proj.weight")
    write_gguf(path2, weights, tensors_raw=[("blk.0.attn_v.weight", np.zeros((KV_HEADS * HEAD_DIM, HIDDEN // block * size),
                                                                            dtype=np.uint8), Q.Q2_K)])
    with pytest.raises(ModelLoadError, match="blk.0.attn_v.weight has quantization Q2_K"):
        load_model(str(path2))


def test_unknown_name_lists_known_models():
    with pytest.raises(ModelLoadError, match="smollm2-135m, tiny-random"):
        load_model("no-such-model")


def test_cli_reports_one_clear_line(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 100)
    proc = subprocess.run([sys.executable, "-m", "sglite.cli", "generate", "hi", "--model-path", str(junk)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "not a GGUF file" in lines[0], proc.stderr


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3.1 RoPE scaling only as the rope_freqs tensor."""
    from sglite.layers.rotary_embedding import _llama3_inv_freq
    from sglite.model_loader.gguf import llama3_rope_factors

    factors = llama3_rope_factors(50000.0, HEAD_DIM, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    assert (factors == 1).any() and (factors == 8).any() and ((factors > 1) & (factors < 8)).any()  # 3 bands
    path = tmp_path / "l3.gguf"
    write_gguf(path, tensors_raw=[("rope_freqs.weight", factors, Q.F32)])
    c = load_model(str(path)).config
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    base = 1.0 / (50000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    ours = _llama3_inv_freq(base, c.rope_scaling)
    assert torch.allclose(ours, base / torch.from_numpy(factors).double(), rtol=1e-6)


def test_rope_freqs_of_unknown_shape_is_refused(tmp_path):
    path = tmp_path / "odd.gguf"
    odd = np.linspace(1.0, 3.0, HEAD_DIM // 2, dtype=np.float32)
    write_gguf(path, tensors_raw=[("rope_freqs.weight", odd, Q.F32)])
    with pytest.raises(ModelLoadError, match="rope_freqs.weight does not match llama3"):
        load_model(str(path))


CONVERT_AND_SUM = """
import os, sys, time
import gguf, safetensors.torch
from sglite.model_loader import load_model
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):  # all start converting within a millisecond
    time.sleep(0.001)
m = load_model(sys.argv[1])
print(sum(float(w.double().sum()) for w in m.weights.values()))
"""


def test_processes_that_load_one_gguf_at_once_convert_it_once(tmp_path, cache_dir):
    """The ranks of --tp-size N (or two servers) started on a cold cache: one converts,
    the others wait for its result."""
    path = tmp_path / "m.gguf"
    write_gguf(path)
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT_AND_SUM, str(path), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        assert p.stdout.readline() == "ready\n"
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(err.count("converting m.gguf once") for _, err in outs) == 1, outs
    assert len({out for out, _ in outs}) == 1
    assert len(list((cache_dir / "converted").iterdir())) == 1


def test_config_alone_reads_no_tensors(tmp_path, cache_dir):
    """What a launcher reads to check --tp-size: the config, without a conversion."""
    from sglite.model_loader import load_model_config

    path = tmp_path / "m.gguf"
    write_gguf(path)
    c = load_model_config(str(path))
    assert (c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers) == (HEADS, KV_HEADS, LAYERS)
    assert not (cache_dir / "converted").exists()
    assert c == load_model(str(path)).config
    with pytest.raises(ModelLoadError, match="not a file or folder"):
        load_model_config(str(tmp_path / "missing"))


def test_damaged_cache_is_converted_again(tmp_path, cache_dir, capsys):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    first = load_model(str(path))
    (entry,) = (cache_dir / "converted").iterdir()
    (entry / "model.safetensors").write_bytes(b"broken")
    second = load_model(str(path))
    assert "converting again" in capsys.readouterr().err
    assert all(torch.equal(first.weights[k], second.weights[k]) for k in first.weights)


def test_missing_metadata_is_named(tmp_path):
    path = tmp_path / "nohidden.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="llama.embedding_length is missing"):
        load_model(str(path))


def test_conversion_progress_ends_at_100_percent(tmp_path):
    """Progress is told every tenth of the tensors, and at the last one whatever their
    number (SmolLM2's 272 stopped at 99%)."""
    from sglite.model_loader.gguf import load_gguf, progress_due

    told = [100 * (i + 1) // 272 for i in range(272) if progress_due(i, 272)]
    assert told == [9, 19, 29, 39, 49, 59, 69, 79, 89, 99, 100]
    path = tmp_path / "m.gguf"
    write_gguf(path)
    said: list[str] = []
    load_gguf(path, progress=said.append)
    assert said and said[-1].endswith(" ... 100%")
