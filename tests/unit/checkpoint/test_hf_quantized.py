"""Quantized Hugging Face folders, dequantized at load: DeepSeek-V3 in fp8 blocks (sizes
that are not multiples of the block, the scales in another shard, modules kept
unquantized) and gpt-oss's MXFP4 experts, each against transformers given the
dequantized weights and against transformers' own dequantizing loader; corrupt folders
refused in one line naming the file and tensor; an export after training is unquantized
and reloads with the same logits."""

import json
import logging
import re

import pytest
import torch
from hf_parity import VOCAB, logits_of, tokens
from safetensors import safe_open
from safetensors.torch import save_file
from test_hf_deepseek_v3 import hf_model as deepseek_model
from test_hf_gpt_oss import hf_model as gpt_oss_model

from recipes_lib.checkpoint.hf import load_hf_checkpoint, model_config_from_hf
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.errors import CheckpointError

transformers = pytest.importorskip("transformers")

FP8_MAX = 448.0  # the largest float8_e4m3fn value
# widths of 72 and expert widths of 20: neither a multiple of a 16-wide block
DEEPSEEK = dict(hidden_size=72, intermediate_size=40, moe_intermediate_size=20)
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\..*proj\.weight")
KEPT = "model.layers.1.self_attn.kv_a_proj_with_mqa"  # in modules_to_not_convert


# ---------------------------------------------------------------- the test's quantizers
def fp8_quantize(weight: torch.Tensor, block: tuple[int, int]):
    """``(fp8 values, fp32 scale_inv)``: each block scaled so its largest value is FP8_MAX."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight
    tiles = padded.view(grid[0], block[0], grid[1], block[1])
    scale_inv = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    scaled = (tiles / scale_inv[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return scaled.to(torch.float8_e4m3fn), scale_inv


def fp8_dequantize(values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
    rows, cols = values.shape
    full = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return values.float() * full[:rows, :cols]


def saved_tensors(folder):
    """The tensors a transformers ``save_pretrained`` wrote (the layout it publishes)."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def write_folder(folder, config, shards):
    """A model folder of ``config`` and ``shards`` (file -> tensors; several: indexed)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {name: file for file, tensors in shards.items() for name in tensors}
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def reference_of(tmp_path, config, state):
    """transformers' model loaded from a folder of the dequantized weights."""
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    write_folder(tmp_path / "dequantized", config, {"model.safetensors": state})
    return transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "dequantized", attn_implementation="eager"
    ).eval()


def fp8_folder(tmp_path, block):
    """A DeepSeek-V3 folder whose attention and MLP weights are fp8 in ``block`` blocks
    (scales in a second shard, one module kept in fp32), transformers' model of the
    dequantized weights, and how many weights are quantized."""
    deepseek_model(**DEEPSEEK).save_pretrained(tmp_path / "full")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    state = saved_tensors(tmp_path / "full")
    weights, scales, dequantized = {}, {}, {}
    for name, tensor in state.items():
        if QUANTIZED.fullmatch(name) and not name.startswith(KEPT):
            values, scale_inv = fp8_quantize(tensor, block)
            weights[name] = values
            scales[f"{name}_scale_inv"] = scale_inv
            dequantized[name] = fp8_dequantize(values, scale_inv, block)
        else:
            weights[name] = tensor
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head", KEPT],
    }
    shards = {"model-00001-of-00002.safetensors": weights}
    shards["model-00002-of-00002.safetensors"] = scales
    write_folder(tmp_path / "fp8", config, shards)
    reference = reference_of(tmp_path, config, {**state, **dequantized})
    return tmp_path / "fp8", reference, len(dequantized)


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP4 = torch.cat([FP4, -FP4])


def mxfp4_quantize(weight: torch.Tensor):
    """``(blocks, scales)`` of an ``(E, in, out)`` expert tensor: its transpose in groups
    of 32 along ``in``, each group scaled by a power of two to at most 6 and rounded to
    the nearest FP4 value, two codes a byte, the first in the low nibble."""
    rows = weight.transpose(1, 2)  # (E, out, in)
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    scaled = groups / torch.pow(2.0, exponent.float())[..., None]
    codes = (scaled[..., None] - FP4).abs().argmin(-1).to(torch.uint8)  # (E, out, G, 32)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()
    values = FP4[codes] * torch.pow(2.0, scales.float() - 127)[..., None]
    return values.flatten(-2).transpose(1, 2)  # (E, out, in) -> (E, in, out)


def mxfp4_folder(tmp_path):
    """A gpt-oss folder whose experts' gate_up_proj and down_proj are MXFP4, transformers'
    model of the dequantized weights, and how many tensors are quantized."""
    gpt_oss_model().save_pretrained(tmp_path / "full")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    state = saved_tensors(tmp_path / "full")
    weights, dequantized = {}, {}
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_quantize(tensor)
            weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
            dequantized[name] = mxfp4_dequantize(blocks, scales).contiguous()
        else:
            weights[name] = tensor
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    write_folder(tmp_path / "mxfp4", config, {"model.safetensors": weights})
    reference = reference_of(tmp_path, config, {**state, **dequantized})
    return tmp_path / "mxfp4", reference, len(dequantized)


def transformers_dequantized(folder, config):
    """transformers' own loader, dequantizing the folder on the CPU."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()


# ---------------------------------------------------------------------------- fp8
@pytest.mark.parametrize("block", [(16, 16), (128, 128), (8, 24)])
def test_an_fp8_folder_is_the_dequantized_model(tmp_path, block, caplog):
    folder, reference, count = fp8_folder(tmp_path, block)
    with caplog.at_level(logging.INFO, logger="recipes_lib.checkpoint.hf"):
        model, config = load_hf_checkpoint(folder)
    assert config.family == "deepseek_v3"
    x = tokens(VOCAB, 2, 24)
    torch.testing.assert_close(logits_of(model, x), logits_of(reference, x), atol=1e-4, rtol=1e-4)
    # the kept module is read as it is
    kept = model.layers[1].attention.wkv_a.weight
    torch.testing.assert_close(kept, reference.model.layers[1].self_attn.kv_a_proj_with_mqa.weight)
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1
    block_text = f"{block[0]}x{block[1]} blocks"
    assert f"{count} tensors dequantized from fp8 ({block_text}) to float32" in lines[0]


def test_a_stage_from_an_fp8_folder_records_that_it_was_dequantized(tmp_path):
    from recipes_lib.pipeline.handoff import handoff_from_path
    from recipes_lib.pipeline.spec import StageSpec

    folder, _, _ = fp8_folder(tmp_path, (16, 16))
    stage = StageSpec(name="sft", recipe="sft/tiny", init="weights", source=str(folder))
    assert handoff_from_path(folder, stage).dequantized == "fp8 (16x16 blocks)"
    assert handoff_from_path(tmp_path / "dequantized", stage).dequantized is None


def test_an_fp8_folder_loads_into_bfloat16(tmp_path):
    folder, _, _ = fp8_folder(tmp_path, (16, 16))
    model, _ = load_hf_checkpoint(folder, dtype=torch.bfloat16)
    gate = model.layers[1].feed_forward.experts.w1.weight[3]
    expected = saved_tensors(tmp_path / "dequantized")
    expected = expected["model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert gate.dtype == torch.bfloat16
    assert torch.equal(gate, expected.to(torch.bfloat16))  # the fp32 product, rounded once


def test_an_fp8_folder_matches_transformers_dequantizing_loader(tmp_path):
    # transformers derives the block from the scale grid, so its dequantization is
    # only right where every width is a multiple of the block: 4 divides them all
    folder, reference, _ = fp8_folder(tmp_path, (4, 4))
    theirs = transformers_dequantized(folder, transformers.FineGrainedFP8Config(dequantize=True))
    model, _ = load_hf_checkpoint(folder)
    x = tokens(VOCAB, 2, 24)
    torch.testing.assert_close(logits_of(model, x), logits_of(theirs, x), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits_of(model, x), logits_of(reference, x), atol=1e-4, rtol=1e-4)


def _rewrite(folder, file, change):
    """Rewrite one shard of ``folder`` with ``change(tensors)`` applied."""
    path = folder / file
    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_a_corrupt_fp8_folder_is_refused_naming_the_file_and_tensor(tmp_path):
    folder, _, _ = fp8_folder(tmp_path, (16, 16))
    weight = "model.layers.1.mlp.experts.3.down_proj.weight"
    scales = "model-00002-of-00002.safetensors"
    index = json.loads((folder / "model.safetensors.index.json").read_text())

    def drop(tensors):
        del tensors[f"{weight}_scale_inv"]

    _rewrite(folder, scales, drop)
    del index["weight_map"][f"{weight}_scale_inv"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(folder)
    message = str(err.value)
    assert "model-00001-of-00002.safetensors" in message and weight in message
    assert "without its" in message and "\n" not in message

    folder, _, _ = fp8_folder(tmp_path / "again", (16, 16))  # whole again

    def reshape(tensors):
        tensors[f"{weight}_scale_inv"] = torch.ones(4, 4)

    _rewrite(folder, scales, reshape)
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(folder)
    message = str(err.value)
    assert scales in message and f"{weight}_scale_inv has shape (4, 4)" in message
    assert "needs (5, 2)" in message and "\n" not in message  # 72 x 20 in 16 x 16 blocks

    # scales beside a weight kept in full precision
    folder, _, _ = fp8_folder(tmp_path / "kept", (16, 16))
    stray = f"{KEPT}.weight_scale_inv"

    def add(tensors):
        tensors[stray] = torch.ones(2, 5)

    _rewrite(folder, scales, add)
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(folder)
    message = str(err.value)
    assert scales in message and f"{stray} scales no fp8 tensor" in message


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"quant_method": "gptq"}, "quant_method='gptq' is not supported"),
        ({"quant_method": "fp8"}, "weight_block_size=None"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
            "scale_fmt='ue8m0'",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            "activation_scheme='static'",
        ),
    ],
)
def test_a_quantization_that_cannot_be_read_is_refused_in_one_line(settings, message):
    config = {**deepseek_model().config.to_dict(), "quantization_config": settings}
    with pytest.raises(CheckpointError, match=re.escape(message)) as err:
        model_config_from_hf(config)
    assert "\n" not in str(err.value)


def test_an_export_after_training_is_unquantized_and_reloads(tmp_path):
    folder, _, _ = fp8_folder(tmp_path, (16, 16))
    model, config = load_hf_checkpoint(folder)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = tokens(VOCAB, 2, 16)
    before = logits_of(model, x)
    for _ in range(2):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    trained = logits_of(model, x)
    assert (trained - before).abs().max() > 1e-3
    out = export_hf_checkpoint(model, config, tmp_path / "exported")
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert not [n for n in f.keys() if n.endswith("_scale_inv")]
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"F32"}
    reloaded, _ = load_hf_checkpoint(out)
    torch.testing.assert_close(logits_of(reloaded, x), trained, atol=1e-5, rtol=1e-5)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    torch.testing.assert_close(logits_of(theirs.eval(), x), trained, atol=1e-4, rtol=1e-4)


def test_a_quantized_image_text_folder_exports_its_text_model_alone(tmp_path):
    """Its text tower is read dequantized; the export does not write it back into the
    base (beside a quantized vision tower) but as the text model, unquantized."""
    from test_gemma3_published_image_text import GEMMA3_4B_IT

    from recipes_lib.checkpoint.hf_image_text import image_text_base

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B_IT))
    assert image_text_base(tmp_path) is not None
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps({**GEMMA3_4B_IT, "quantization_config": fp8}))
    assert image_text_base(tmp_path) is None


# ---------------------------------------------------------------------------- mxfp4
def test_an_mxfp4_folder_is_the_dequantized_model(tmp_path, caplog):
    folder, reference, count = mxfp4_folder(tmp_path)
    with caplog.at_level(logging.INFO, logger="recipes_lib.checkpoint.hf"):
        model, config = load_hf_checkpoint(folder)
    assert config.family == "gpt_oss"
    x = tokens(VOCAB, 2, 24)
    torch.testing.assert_close(logits_of(model, x), logits_of(reference, x), atol=1e-4, rtol=1e-4)
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1 and f"{count} tensors dequantized from mxfp4" in lines[0]


def test_an_mxfp4_folder_matches_transformers_dequantizing_loader(tmp_path):
    folder, _, _ = mxfp4_folder(tmp_path)
    theirs = transformers_dequantized(folder, transformers.Mxfp4Config(dequantize=True))
    model, _ = load_hf_checkpoint(folder)
    x = tokens(VOCAB, 2, 24)
    torch.testing.assert_close(logits_of(model, x), logits_of(theirs, x), atol=1e-4, rtol=1e-4)


def test_an_mxfp4_folder_into_bfloat16_is_exact(tmp_path):
    folder, _, _ = mxfp4_folder(tmp_path)
    model, _ = load_hf_checkpoint(folder, dtype=torch.bfloat16)
    down = model.layers[2].feed_forward.experts.w2.weight  # (E, C, F): the transpose
    expected = saved_tensors(tmp_path / "dequantized")["model.layers.2.mlp.experts.down_proj"]
    assert down.dtype == torch.bfloat16 and torch.equal(down.float(), expected.transpose(1, 2))


@pytest.mark.parametrize(
    ("change", "tensor", "message"),
    [
        ("drop", "down_proj_scales", "down_proj_blocks has no"),
        ("reshape", "down_proj_scales", "down_proj_scales is U8 (4, 32, 1)"),
    ],
)
def test_a_corrupt_mxfp4_folder_is_refused_naming_the_file_and_tensor(
    tmp_path, change, tensor, message
):
    folder, _, _ = mxfp4_folder(tmp_path)
    name = f"model.layers.2.mlp.experts.{tensor}"

    def damage(tensors):
        if change == "drop":
            del tensors[name]
        else:
            tensors[name] = tensors[name][:, :32].contiguous()

    _rewrite(folder, "model.safetensors", damage)
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(folder)
    text = str(err.value)
    assert "model.safetensors" in text and message in text and "\n" not in text
