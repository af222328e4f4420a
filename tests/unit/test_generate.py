import json
from dataclasses import asdict

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf
from tiny import quiet_trainer, tiny_model_config
from torch.utils.data import DataLoader

from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.checkpoint.weights import save_weights
from recipes_lib.cli import generate_command as main
from recipes_lib.config.schema import (
    KernelsConfig,
    ModelConfig,
    OptimConfig,
    RopeScalingConfig,
    RunConfig,
    SchedulerConfig,
)
from recipes_lib.data.tokenizer import save_tokenizer, train_bpe_tokenizer
from recipes_lib.errors import CheckpointError, ConfigError, DataError
from recipes_lib.generate import generate, load_for_generation, sample_token
from recipes_lib.models import KVCache, Transformer

VOCAB = 300  # holds a byte-level BPE tokenizer (256 bytes + EOS + merges)
PROMPT = [5, 17, 42, 99, 3, 250, 7]


def tiny(**overrides) -> ModelConfig:
    return tiny_model_config(
        **{"vocab_size": VOCAB, "dim": 64, "ffn_dim": 96, "max_seq_len": 96, **overrides}
    )


def build(config: ModelConfig | None = None, attention="sdpa", seed=0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(config or tiny(), attention).eval()
    with torch.no_grad():  # unit norms and zero biases would hide mistakes
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


VARIANTS = {
    "gqa": {},
    "mha-bias": {"n_kv_heads": None, "qkv_bias": True, "family": "qwen2"},
    "mqa-tied": {"n_kv_heads": 1, "tie_embeddings": True},
    "llama3-rope": {
        "rope_scaling": RopeScalingConfig(type="llama3", factor=4.0, original_max_seq_len=16)
    },
}


# ------------------------------------------------------------------- KV cache
@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_greedy_equals_recomputed_greedy(variant):
    # weights large enough that greedy decoding does not just repeat one token
    model = build(tiny(init_std=0.3, **VARIANTS[variant]))
    cached = generate(model, PROMPT, 40)
    recomputed = generate(model, PROMPT, 40, use_cache=False)
    assert cached == recomputed and len(cached) == 40
    assert len(set(cached)) > 1  # not a degenerate model


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_logits_equal_the_full_forward_at_every_step(variant):
    model = build(tiny(**VARIANTS[variant]))
    sequence = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(sequence)  # (2, 40, V)
        assert full.abs().max() > 0.1  # logits of a size where atol=1e-5 is a real test
        cache = KVCache.for_model(model, batch_size=2, max_len=40)
        prefill = model(sequence[:, :7], cache=cache)  # (2, 7, V)
        torch.testing.assert_close(prefill, full[:, :7], atol=1e-5, rtol=1e-5)
        for t in range(7, 30):  # one token at a time
            step = model(sequence[:, t : t + 1], cache=cache)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
        chunk = model(sequence[:, 30:40], cache=cache)  # several after a cached prefix
        torch.testing.assert_close(chunk, full[:, 30:40], atol=1e-5, rtol=1e-5)
    assert cache.length == 40


def test_start_pos_rewinds_the_cache():
    model = build()
    x = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    other = x.clone()
    other[0, 12:] = (x[0, 12:] + 1) % VOCAB
    with torch.no_grad():
        cache = KVCache.for_model(model, max_len=20)
        model(x, cache=cache)
        rewound = model(other[:, 12:], cache=cache, start_pos=12)
        torch.testing.assert_close(rewound, model(other)[:, 12:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="the cache holds 20 positions"):
        model(x[:, :1], cache=cache, start_pos=21)
    with pytest.raises(ConfigError, match="do not fit the KV cache of 20 positions"):
        model(x[:, :1], cache=cache)
    with pytest.raises(ValueError, match="needs a KV cache"):
        model(x, start_pos=3)


def test_cache_works_for_a_flex_trained_model():
    model = build(attention="flex")
    assert generate(model, PROMPT, 12) == generate(model, PROMPT, 12, use_cache=False)


def test_generation_leaves_training_mode_and_the_training_path_alone():
    model = build().train()
    x = torch.tensor([PROMPT])
    before = model(x)
    generate(model, PROMPT, 5)
    assert model.training
    torch.testing.assert_close(model(x), before, atol=0, rtol=0)


# ------------------------------------------------------------------ sampling
def test_sampling_is_reproducible_with_a_seed():
    model = build()
    first = generate(model, PROMPT, 30, temperature=1.5, top_p=0.95, seed=3)
    assert first == generate(model, PROMPT, 30, temperature=1.5, top_p=0.95, seed=3)
    assert first != generate(model, PROMPT, 30, temperature=1.5, top_p=0.95, seed=4)
    assert first != generate(model, PROMPT, 30)  # not greedy
    cached = generate(model, PROMPT, 30, temperature=1.5, top_p=0.95, seed=3, use_cache=False)
    assert first == cached


def test_sampled_tokens_lie_in_the_nucleus():
    model = build()
    top_p, temperature = 0.6, 2.0
    new = generate(model, PROMPT, 30, temperature=temperature, top_p=top_p, seed=0)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + new]))[0, len(PROMPT) - 1 : -1]  # (30, V)
    nucleus_sizes = []
    for step_logits, token in zip(logits, new, strict=True):
        probs = torch.softmax(step_logits / temperature, -1)
        sorted_probs, order = probs.sort(descending=True)
        size = int((sorted_probs.cumsum(0) < top_p).sum()) + 1
        assert token in order[:size].tolist()
        nucleus_sizes.append(size)
    assert max(nucleus_sizes) > 1  # sampling had a choice to make
    # a vanishing nucleus is greedy decoding
    assert generate(model, PROMPT, 20, temperature=1.0, top_p=1e-9, seed=1) == generate(
        model, PROMPT, 20
    )


def test_generation_stops_at_eos():
    model = build()
    free = generate(model, PROMPT, 30, temperature=1.5, seed=5)
    eos = free[6]
    stop = free.index(eos)
    assert generate(model, PROMPT, 30, temperature=1.5, seed=5, eos_id=eos) == free[: stop + 1]
    greedy = generate(model, PROMPT, 30)
    several = {greedy[3], VOCAB - 1}
    assert generate(model, PROMPT, 30, eos_id=several) == greedy[: greedy.index(greedy[3]) + 1]


def test_sample_token_greedy_and_nucleus():
    logits = torch.tensor([0.0, 3.0, 2.9, -5.0])  # probabilities ~ 0.03, 0.51, 0.46, 0.0
    assert sample_token(logits, 0.0, 1.0, None) == 1
    gen = torch.Generator().manual_seed(0)
    assert {sample_token(logits, 1.0, 0.5, gen) for _ in range(50)} == {1}
    assert {sample_token(logits, 1.0, 0.95, gen) for _ in range(100)} == {1, 2}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_ids": []}, "at least one token"),
        ({"max_new_tokens": 91}, "need 97 positions, more than model.max_seq_len=96"),
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_p": 0.0}, "top_p=0.0"),
    ],
)
def test_bad_generation_requests_are_config_errors(kwargs, message):
    args = {"prompt_ids": PROMPT, "max_new_tokens": 4, **kwargs}
    with pytest.raises(ConfigError, match=message):
        generate(build(), **args)


def test_longest_generation_fits_exactly():
    model = build()
    assert len(generate(model, PROMPT, 96 - len(PROMPT) + 1)) == 96 - len(PROMPT) + 1
    assert generate(model, PROMPT, 0) == []


def test_greedy_matches_transformers_generate(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = build(tiny(qkv_bias=True, family="qwen2"))
    export_hf_checkpoint(model, model.config, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    expected = hf.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=25,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(PROMPT) :].tolist()
    assert generate(model, PROMPT, 25) == expected


# ------------------------------------------------------------------- loading
@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    texts = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n"] * 30
    tokenizer = train_bpe_tokenizer(texts, vocab_size=VOCAB)
    return save_tokenizer(tokenizer, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def assert_same_weights(loaded: Transformer, model: Transformer):
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def train_lightning_run(run_dir):
    """A two-step CausalLMModule run whose last.ckpt lands in run_dir/checkpoints."""
    from recipes_lib.training import CausalLMModule

    module = CausalLMModule(
        tiny(max_seq_len=32),
        KernelsConfig(),
        OptimConfig(lr=1e-3),
        SchedulerConfig(name="constant", warmup=0),
        total_steps=2,
        tokens_per_step=2 * 16,
    )
    tokens = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    batches = [
        {"input_ids": tokens[i : i + 2, :-1], "labels": tokens[i : i + 2, 1:]} for i in (0, 2)
    ]
    saver = ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True)
    trainer = quiet_trainer(2, [saver], default_root_dir=run_dir)
    trainer.fit(module, DataLoader(batches, batch_size=None))
    return module.model, run_dir / "checkpoints" / "last.ckpt"


def test_load_lightning_checkpoint_finds_the_run_tokenizer(tmp_path, tokenizer_file):
    model, ckpt = train_lightning_run(tmp_path / "run")
    with pytest.raises(DataError, match="no tokenizer found") as err:
        load_for_generation(ckpt)
    assert str(tmp_path / "run" / "tokenizer.json") in str(err.value)

    (tmp_path / "run" / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    loaded = load_for_generation(ckpt)
    assert loaded.kind == "lightning" and loaded.config == model.config
    assert loaded.eos_ids == [0]  # <|endoftext|>
    assert_same_weights(loaded.model, model)
    assert len(generate(loaded.model, PROMPT, 5)) == 5

    explicit = load_for_generation(ckpt, tokenizer=tokenizer_file.parent)
    assert explicit.tokenizer.to_str() == loaded.tokenizer.to_str()


def test_load_native_export_with_its_run_config(tmp_path, tokenizer_file):
    model = build(tiny(tie_embeddings=True))
    save_weights(model.state_dict(), tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="says the model's shape"):
        load_for_generation(tmp_path)
    run_config = RunConfig(model=model.config)
    run_config.data.tokenizer.path = str(tokenizer_file)
    OmegaConf.save(OmegaConf.structured(run_config), tmp_path / "config.yaml")
    loaded = load_for_generation(tmp_path, dtype=torch.bfloat16)
    assert loaded.kind == "native" and loaded.config == model.config
    assert loaded.model.output.weight is loaded.model.tok_embeddings.weight
    assert loaded.model.tok_embeddings.weight.dtype == torch.bfloat16
    expected = model.tok_embeddings.weight.to(torch.bfloat16)
    torch.testing.assert_close(loaded.model.tok_embeddings.weight, expected, atol=0, rtol=0)


def test_load_native_export_with_a_stage_manifest(tmp_path, tokenizer_file):
    model = build()
    save_weights(model.state_dict(), tmp_path / "model.safetensors")
    (tmp_path / "tok.json").write_bytes(tokenizer_file.read_bytes())
    manifest = {"model": asdict(model.config), "tokenizer": {"path": "tok.json", "sha256": ""}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    loaded = load_for_generation(tmp_path / "model.safetensors")
    assert loaded.kind == "native"
    assert_same_weights(loaded.model, model)
    assert loaded.tokenizer.encode("def add").ids


def test_load_hugging_face_folder(tmp_path, tokenizer_file):
    model = build(tiny(qkv_bias=True, family="qwen2"))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    export_hf_checkpoint(model, model.config, tmp_path, tokenizer_file, chat_template=template)
    loaded = load_for_generation(tmp_path)
    assert loaded.kind == "hf" and loaded.chat_template == template and loaded.eos_ids == [0]
    assert_same_weights(loaded.model, model)


@pytest.mark.parametrize("what", ["missing", "empty-folder"])
def test_missing_checkpoint_names_the_path(tmp_path, what):
    path = tmp_path / "nothing"
    if what == "empty-folder":
        path.mkdir()
    with pytest.raises(CheckpointError, match=str(path)):
        load_for_generation(path)


# ----------------------------------------------------------------------- CLI
def test_cli_prints_the_prompt_and_its_continuation(tmp_path, tokenizer_file, capsys):
    model = build()
    export_hf_checkpoint(model, model.config, tmp_path, tokenizer_file)
    args = [f"checkpoint={tmp_path}", "prompt=def add", "max_new_tokens=8", "device=cpu"]
    sampled = [*args, "temperature=0.8", "top_p=0.95", "seed=0"]
    assert main(sampled) == 0
    first = capsys.readouterr().out
    assert first.startswith("def add") and len(first) > len("def add\n")
    assert main(sampled) == 0
    assert capsys.readouterr().out == first  # seeded

    assert main(args) == 0  # greedy: the tokens generate() gives
    tokenizer = load_for_generation(tmp_path).tokenizer
    ids = tokenizer.encode("def add").ids
    expected = tokenizer.decode(ids + generate(model, ids, 8, eos_id=0))
    assert capsys.readouterr().out == expected + "\n"


def test_cli_takes_text_as_written_and_writes_nothing_in_the_folder(
    tmp_path, tokenizer_file, capsys, monkeypatch
):
    model = build()
    export_hf_checkpoint(model, model.config, tmp_path / "hf", tokenizer_file)
    monkeypatch.chdir(tmp_path)
    prompt = "a, b (c) [d] {e} ${f} it's \\ "
    args = [f"checkpoint={tmp_path / 'hf'}", f"prompt={prompt}", "max_new_tokens=3"]
    assert main([*args, "device=cpu", "seed=null", "tokenizer=null"]) == 0
    assert capsys.readouterr().out.startswith(prompt)  # commas, brackets, ${ and spaces kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no outputs/, no .hydra/


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["prompt=x"], "error: checkpoint: required; pass checkpoint=PATH"),
        (["checkpoint=/no/such/ckpt"], "error: checkpoint='/no/such/ckpt': no such file"),
        (
            ["checkpoint=x", "temprature=1"],
            "error: temprature=1: no such key (did you mean temperature?)",
        ),
        (["checkpoint=x", "max_new_tokens=many"], "error: max_new_tokens=many: Value 'many'"),
        (["checkpoint=x", "top_p=[1]"], "error: top_p=[1]: "),
        (["checkpoint=x", "dtype=float64"], "error: dtype=float64: Invalid value 'float64'"),
        (["checkpoint=x", "temperature=0.5,1"], "error: temperature=0.5,1: a sweep"),
        (["checkpoint=x", "-m"], "error: --multirun: recipes-generate runs one job"),
        (["checkpoint"], "error: checkpoint: not key=value"),
    ],
)
def test_cli_errors_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert not out and err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_cli_help_prints_the_keys_their_defaults_and_an_example(flag, capsys):
    assert main([flag, "top_p=0.5"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint: ???" in out and "max_new_tokens: 64" in out
    assert "top_p: 0.5" in out  # the defaults as this command line sets them
    assert "recipes-generate checkpoint=" in out
