"""Weight sources: a shard reads only its tensors; fingerprints; clear errors; GGUF files as llama.cpp writes them."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from flowspec_p2p.errors import ConfigError, UnsupportedModel, WeightsError
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import (
    _GGUF_GLOBAL,
    _GGUF_LAYER,
    EMBED,
    HEAD,
    NORM,
    GGUFSource,
    dequantize,
    layer_tensor_names,
    model_fingerprint,
    open_source,
    range_fingerprint,
)
from flowspec_p2p.types import LayerRange

from ..gguf_fixtures import write_random_gguf


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from a second thread, and lose milliseconds per op when the cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class SpySource:
    """A WeightSource that records every tensor it is asked to materialise."""

    def __init__(self, inner):
        self.inner, self.config, self.path = inner, inner.config, inner.path
        self.loaded: list[str] = []

    def names(self) -> list[str]:
        return self.inner.names()

    def load(self, name: str) -> torch.Tensor:
        self.loaded.append(name)
        return self.inner.load(name)

    def raw_bytes(self, name: str) -> memoryview:
        return self.inner.raw_bytes(name)

    def raw_info(self, name: str) -> dict:
        return self.inner.raw_info(name)


# ------------------------------------------------------------------------------------- loading by range


@pytest.mark.parametrize("kind", ["llama", "llama-untied"])
def test_a_quarter_of_the_layers_materialises_only_its_tensors(tiny_checkpoints, kind):
    spy = SpySource(open_source(tiny_checkpoints[kind]))
    cfg = spy.config
    assert cfg.num_layers == 4
    roles = {  # (range, embed, head) -> what exactly must be read
        (0, False, False): layer_tensor_names(cfg, 0),
        (1, False, False): layer_tensor_names(cfg, 1),
        (0, True, False): [EMBED, *layer_tensor_names(cfg, 0)],
        (3, False, True): [*layer_tensor_names(cfg, 3), NORM, EMBED if cfg.tie_embeddings else HEAD],
        (3, True, True): [EMBED, *layer_tensor_names(cfg, 3), NORM, *([] if cfg.tie_embeddings else [HEAD])],
    }
    for (layer, embed, head), expected in roles.items():
        spy.loaded.clear()
        TorchShard.from_source(spy, LayerRange(start=layer, end=layer + 1), embed=embed, head=head, dtype=torch.float64)
        assert Counter(spy.loaded) == Counter(expected), (layer, embed, head)


def test_a_gguf_shard_materialises_only_its_tensors(tmp_path, tiny_checkpoints):
    spy = SpySource(open_source(_write_gguf(tmp_path / "m.gguf", tiny_checkpoints["llama"])))
    TorchShard.from_source(spy, LayerRange(start=2, end=3), embed=False, head=False)
    assert sorted(spy.loaded) == sorted(layer_tensor_names(spy.config, 2))


# ------------------------------------------------------------------------------------------ fingerprints


def test_fingerprints_are_deterministic_and_per_range(tiny_llama):
    a, b = open_source(tiny_llama), open_source(tiny_llama)
    r = LayerRange(start=1, end=3)
    assert range_fingerprint(a, r, embed=False, head=False) == range_fingerprint(b, r, embed=False, head=False)
    assert model_fingerprint(a) == model_fingerprint(b)
    others = {
        range_fingerprint(a, LayerRange(start=1, end=2), embed=False, head=False),
        range_fingerprint(a, r, embed=True, head=False),
        range_fingerprint(a, r, embed=False, head=True),
    }
    assert range_fingerprint(a, r, embed=False, head=False) not in others
    assert len(others) == 3


def test_changing_one_tensor_changes_only_the_fingerprints_that_cover_it(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "edited"
    shutil.copytree(tiny_llama, copy)
    (st,) = copy.glob("*.safetensors")
    tensors = load_file(st)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] += 1e-12
    save_file(tensors, st, metadata={"format": "pt"})
    old, new = open_source(tiny_llama), open_source(copy)
    for start, end, changed in ((1, 2, True), (0, 4, True), (2, 4, False), (0, 1, False)):
        r = LayerRange(start=start, end=end)
        same = range_fingerprint(old, r, embed=False, head=False) == range_fingerprint(new, r, embed=False, head=False)
        assert same != changed, (start, end)
    assert model_fingerprint(old) != model_fingerprint(new)


def _mapped_kb(path: Path) -> int:
    """Resident kB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
            ours = head[-1] == str(path)
        elif ours and head[0] == "Rss:":
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_fingerprinting_a_gguf_file_leaves_none_of_its_pages_resident(tmp_path):
    """Hashing maps the pages around each tensor too (the kernel's fault-around), which releasing the tensor's own
    range leaves behind: range_fingerprint drops the whole mapping's pages after hashing."""
    path = write_random_gguf(tmp_path / "m.gguf", "Q8_0", layers=4, vocab=2048).resolve()
    source = GGUFSource(path)
    model_fingerprint(source)
    assert _mapped_kb(path) == 0
    source.raw_bytes(EMBED).tobytes()  # the pages are read again when used
    assert _mapped_kb(path) > 0


# ---------------------------------------------------------------------------------------------- errors


def test_open_source_errors_say_what_is_wrong(tmp_path, tiny_llama):
    with pytest.raises(ConfigError, match="does not exist"):
        open_source(tmp_path / "nowhere.gguf")
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ConfigError, match=r"neither a \.gguf file nor a HF checkpoint folder"):
        open_source(tmp_path / "model.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        open_source(tmp_path / "empty")
    (tmp_path / "no_weights").mkdir()
    shutil.copy(tiny_llama / "config.json", tmp_path / "no_weights")
    with pytest.raises(WeightsError, match=r"no \*\.safetensors"):
        open_source(tmp_path / "no_weights")
    (tmp_path / "fake.gguf").write_bytes(b"PK\3\4" + b"\0" * 60)
    with pytest.raises(WeightsError, match="not a GGUF file"):
        open_source(tmp_path / "fake.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(WeightsError, match="too short"):
        open_source(tmp_path / "empty.gguf")
    with pytest.raises(WeightsError, match="truncated"):
        open_source(_write_gguf(tmp_path / "cut.gguf", tiny_llama, cut=100))
    with pytest.raises(WeightsError, match="has no tensor"):
        open_source(tiny_llama).load("model.layers.9.mlp.up_proj.weight")


def test_an_unsupported_gguf_architecture_names_the_supported_ones(tmp_path, tiny_llama):
    with pytest.raises(UnsupportedModel, match="supported: llama, mistral, qwen2"):
        open_source(_write_gguf(tmp_path / "gpt2.gguf", tiny_llama, arch="gpt2"))


# ------------------------------------------------------------------------------------------------- GGUF


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: rotate-half q/k rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, folder: Path, *, arch: str | None = None, qtypes: dict | None = None, cut: int = 0) -> Path:
    """Write a HF checkpoint folder as llama.cpp's converter would: GGUF names, q/k rows permuted (llama),
    F32 tensors unless ``qtypes`` maps a GGUF tensor name to a quantisation type. ``cut``: drop the last bytes."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = arch or cfg["model_type"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    to_gguf = {hf: g for g, hf in _GGUF_GLOBAL.items()}
    for i in range(cfg["num_hidden_layers"]):
        to_gguf |= {f"model.layers.{i}.{hf}": f"blk.{i}.{g}" for g, hf in _GGUF_LAYER.items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    for name, t in sorted(load_file(folder / "model.safetensors").items()):
        if name == HEAD and cfg.get("tie_word_embeddings"):
            continue
        arr = t.to(torch.float32).numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = _permute(arr, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = _permute(arr, kv_heads)
        qtype = (qtypes or {}).get(to_gguf[name])
        if qtype is None:
            w.add_tensor(to_gguf[name], np.ascontiguousarray(arr))
        else:
            w.add_tensor(to_gguf[name], gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if cut:
        data = path.read_bytes()
        path.write_bytes(data[:-cut])
    return path


@pytest.mark.parametrize("kind", ["llama", "llama-untied", "qwen2"])
def test_gguf_loader_reproduces_transformers_logits(tmp_path, tiny_checkpoints, kind):
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoints[kind]
    src = open_source(_write_gguf(tmp_path / f"{kind}.gguf", folder))
    assert isinstance(src, GGUFSource)
    ref_cfg = open_source(folder).config
    assert src.config.rms_eps == pytest.approx(ref_cfg.rms_eps, rel=1e-7)  # GGUF stores it as float32
    assert src.config == ref_cfg.model_copy(update={"rms_eps": src.config.rms_eps})
    assert src.config.tie_embeddings == (kind != "llama-untied")
    shard = TorchShard.from_source(src, LayerRange(start=0, end=4), embed=True, head=True, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = shard.logits(shard(ids, None))
        ref = hf(ids).logits
    assert (ours - ref).abs().max().item() <= 1e-4


def test_gguf_header_parse_agrees_with_gguf_reader(tmp_path, tiny_llama):
    import gguf

    path = _write_gguf(tmp_path / "q.gguf", tiny_llama, qtypes={"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q8_0})
    ours = open_source(path)
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        assert ours.metadata[key] == field.contents(), key
    by_gguf_name = {t.name: t for t in reader.tensors}
    for hf_name, t in ours._tensors.items():
        ref = by_gguf_name[t.name]
        info = ours.raw_info(hf_name)
        assert bytes(ours.raw_bytes(hf_name)) == ref.data.tobytes()
        assert (info["byte_shape"], info["dtype"], info["qtype"]) == (list(ref.data.shape), str(ref.data.dtype),
                                                                      ref.tensor_type.name)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_1"])
def test_dequantize_is_bit_identical_to_gguf_py(qtype, monkeypatch):
    import gguf

    from flowspec_p2p.model import gguf_file as weights

    monkeypatch.setattr(weights, "DEQUANT_CHUNK_BLOCKS", 5)  # 12 blocks: several chunks and a partial one

    t = gguf.GGMLQuantizationType[qtype]
    data = np.random.default_rng(0).normal(size=(6, 64)).astype(np.float32) * 3
    data[0, :32] = 0.0  # an all-zero block (scale 0)
    raw = gguf.quants.quantize(data, t)
    ref = gguf.quants.dequantize(raw, t)
    ours = dequantize(torch.from_numpy(raw.copy()).view(torch.uint8).reshape(-1), t, (6, 64))
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.numpy(), ref)


def test_quantised_gguf_tensors_load_as_gguf_py_dequantises_them(tmp_path, tiny_llama):
    import gguf

    from flowspec_p2p.model.weights import unpermute_rows

    Q = gguf.GGMLQuantizationType
    qtypes = {"blk.1.attn_q.weight": Q.Q4_1, "blk.1.ffn_down.weight": Q.Q4_0, "token_embd.weight": Q.Q8_0}
    src = open_source(_write_gguf(tmp_path / "q.gguf", tiny_llama, qtypes=qtypes))
    reader = gguf.GGUFReader(str(src.path))
    by_name = {t.name: t for t in reader.tensors}
    for gguf_name, hf_name in (("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight"),
                               ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
                               ("token_embd.weight", EMBED)):
        t = by_name[gguf_name]
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        if gguf_name.endswith("attn_q.weight"):
            ref = unpermute_rows(ref, src.config.num_heads)
        assert np.array_equal(src.load(hf_name).numpy(), ref), gguf_name
