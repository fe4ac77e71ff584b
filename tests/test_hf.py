"""`nag-lightning export --format hf`: a pre-norm model is a Llama checkpoint that plain transformers
computes (in a process that never imports this package), every other residual and router loads
through the Auto classes `import nag_lightning.hf` registers, with the package's logits, its
greedy generation and its token ids; the folder reads back into the package, and what does not
fit is said in one sentence. The tests skip where transformers (the extra `hf`) is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nag_lightning import RESIDUALS, ROUTERS
from nag_lightning.checkpoints.export import export_checkpoint
from nag_lightning.checkpoints.loading import load_model
from nag_lightning.checkpoints.reader import read_saved
from nag_lightning.data.bpe_training import train_bpe
from nag_lightning.data.tokenizer import HFTokenizer
from nag_lightning.model.inference import generate_cached
from tests.helpers import run_cli
from tests.test_export import said_once, save_like_fit, tiny_module

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("nag_lightning.hf")
pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
PROMPT = "def main"


def exported(root: Path, residual: str, router: str = "none", **arch) -> tuple[Path, Path]:
    """A tiny model's checkpoint and its export as a transformers folder."""
    ckpt = save_like_fit(tiny_module(residual, router, **arch), root / f"{residual}-{router}.ckpt")
    return ckpt, export_checkpoint(str(ckpt), str(root / f"{residual}-{router}"), format="hf")


def package_logits(ckpt: Path, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return load_model(ckpt).model(ids).logits


def package_continuation(ckpt: Path, prompt: str, n: int = 6) -> list[int]:
    """The package's own greedy continuation of `prompt` (its KV-cache generation)."""
    results, _ = generate_cached(load_model(ckpt).model, [list(prompt.encode())], n)
    return results[0].tokens


PLAIN_TRANSFORMERS = """
import json, sys
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

folder, ids, prompt = sys.argv[1], torch.tensor(json.loads(sys.argv[2])), sys.argv[3]
model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
with torch.no_grad():
    logits = model(ids).logits
encoded = tokenizer(prompt, return_tensors="pt")
generated = model.generate(**encoded, max_new_tokens=6, do_sample=False)[0].tolist()
generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
text = generator(prompt, max_new_tokens=6, do_sample=False)
save_file({"logits": logits}, folder + "-logits.safetensors")
print(json.dumps({"model": type(model).__name__, "prompt_ids": encoded["input_ids"][0].tolist(),
                  "generated": generated, "text": text[0]["generated_text"],
                  "ours_imported": sorted(m for m in sys.modules if m.startswith("nag_"))}))
"""


def test_a_prenorm_export_is_a_llama_checkpoint_that_plain_transformers_computes(tmp_path):
    from safetensors.torch import load_file

    ckpt, folder = exported(tmp_path, "prenorm")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert not [p for p in folder.iterdir() if p.suffix not in (".json", ".safetensors")]  # no code
    # its own process, started outside the checkout, with nothing of this package on its path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PLAIN_TRANSFORMERS, str(folder), json.dumps(IDS.tolist()),
                           PROMPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["model"] == "LlamaForCausalLM" and seen["ours_imported"] == []
    theirs = load_file(str(folder) + "-logits.safetensors")["logits"]
    assert (theirs - package_logits(ckpt)).abs().max() < 1e-4
    assert seen["prompt_ids"] == list(PROMPT.encode())
    continuation = package_continuation(ckpt, PROMPT)
    assert seen["generated"] == list(PROMPT.encode()) + continuation
    assert seen["text"] == (PROMPT.encode() + bytes(continuation)).decode("utf-8", errors="replace")


@pytest.mark.parametrize("residual", RESIDUALS.names())
@pytest.mark.parametrize("router", ROUTERS.names())
def test_every_residual_and_router_loads_through_the_auto_classes_with_the_packages_logits(
        tmp_path, residual, router):
    ckpt, folder = exported(tmp_path, residual, router)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    expected = "LlamaForCausalLM" if (residual, router) == ("prenorm", "none") else "NagLightningForCausalLM"
    assert type(model).__name__ == expected
    with torch.no_grad():
        assert (model(IDS).logits - package_logits(ckpt)).abs().max() < 1e-4
    transformer, tokenizer = hf.read_hf(folder)  # and back into the package
    with torch.no_grad():
        assert torch.equal(transformer(IDS).logits, package_logits(ckpt))
    assert tokenizer == read_saved(ckpt).tokenizer


@pytest.mark.parametrize("router", ["none", "threshold", "topk"])
def test_nag_generates_as_the_package_does_alone_and_in_a_left_padded_batch(tmp_path, router):
    ckpt, folder = exported(tmp_path, "nag", router)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = [PROMPT, "x = 1"]
    generated = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)(
        PROMPT, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    continuation = package_continuation(ckpt, PROMPT)
    assert generated == (PROMPT.encode() + bytes(continuation)).decode("utf-8", errors="replace")

    tokenizer.pad_token, tokenizer.padding_side = tokenizer.convert_ids_to_tokens(0), "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert not batch["attention_mask"].all()  # the second prompt is padded
    out = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0)
    width = batch["input_ids"].shape[1]
    assert [out[i, width:].tolist() for i in range(2)] == [package_continuation(ckpt, p) for p in prompts]
    with torch.no_grad():  # the logits of each padded row's real tokens are those of the row alone
        padded = model(**batch).logits[1, -len(prompts[1]):]
        assert (padded - package_logits(ckpt, torch.tensor([list(b"x = 1")]))[0]).abs().max() < 1e-4


def test_saving_the_loaded_model_again_keeps_its_settings_and_logits(tmp_path):
    ckpt, folder = exported(tmp_path, "nag", "threshold")
    transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert again.config.extra_state == json.loads((folder / "config.json").read_text())["extra_state"]
    with torch.no_grad():
        assert (again(IDS).logits - package_logits(ckpt)).abs().max() < 1e-4


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return HFTokenizer(train_bpe(["def main(): return 1\n" * 50, "class A: pass\n" * 50], 300), "bpe:300")


@pytest.mark.parametrize("residual", ["prenorm", "nag"])
def test_the_tokenizer_gives_the_packages_ids_and_bytes(tmp_path, bpe, residual):
    text = "def main(): pass\n  añ €\n"
    for tokenizer in (None, bpe):
        module = tiny_module(residual, vocab_size=tokenizer.vocab_size if tokenizer else 256)
        if tokenizer is not None:
            module.set_tokenizer(tokenizer)
        ckpt = save_like_fit(module, tmp_path / "model.ckpt")
        folder = export_checkpoint(str(ckpt), str(tmp_path / f"{residual}-{tokenizer is None}"), format="hf")
        ours, theirs = read_saved(ckpt).tokenizer, transformers.AutoTokenizer.from_pretrained(folder)
        ids = ours.encode(text.encode()).tolist()
        assert theirs(text)["input_ids"] == ids
        assert theirs.decode(ids) == text and theirs.decode(ids[:3]) == ours.decode(ids[:3]).decode(
            "utf-8", errors="replace")
        assert hf.read_hf(folder)[1] == ours


def test_a_sharded_or_tied_llama_folder_reads_back(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt, folder = exported(tmp_path, "prenorm")
    weights = load_file(str(folder / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({name: weights[name] for name in part}, str(folder / file))
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {name: file for file, part in shards.items() for name in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _ = hf.read_hf(folder)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, package_logits(ckpt))

    del weights["lm_head.weight"]  # a Llama that ties its head to the embedding
    tied = tmp_path / "tied"
    tied.mkdir()
    save_file(weights, str(tied / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tied / name).write_bytes((folder / name).read_bytes())
    (tied / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                  "tie_word_embeddings": True}))
    model, _ = hf.read_hf(tied)
    assert torch.equal(model.head.weight, weights["model.embed_tokens.weight"])


def edit_json(folder: Path, name: str, **changes) -> None:
    path = folder / name
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


LLAMA_SETTINGS = {
    "grouped-query": ({"num_key_value_heads": 1}, "num_key_value_heads 1 below num_attention_heads 2"),
    "biases": ({"attention_bias": True, "mlp_bias": True},
               "attention_bias (the projections have no bias), mlp_bias"),
    "rope scaling": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope type 'llama3'"),
    "activation": ({"hidden_act": "gelu"}, "hidden_act 'gelu' (only silu)"),
    "another model": ({"model_type": "gpt2"}, "holds a model of type 'gpt2'"),
}


@pytest.mark.parametrize("case", LLAMA_SETTINGS)
def test_a_llama_folder_with_settings_the_package_cannot_express_is_refused_in_one_sentence(tmp_path, case):
    changes, expected = LLAMA_SETTINGS[case]
    _, folder = exported(tmp_path, "prenorm")
    edit_json(folder, "config.json", **changes)
    with pytest.raises(ValueError, match="^[^\n]*" + expected.replace("(", r"\(").replace(")", r"\)")):
        hf.read_hf(folder)


def test_a_tokenizer_that_does_not_match_its_model_is_refused_in_one_sentence(tmp_path, bpe):
    _, nag = exported(tmp_path, "nag")
    (nag / "tokenizer.json").write_text(bpe.json_text)
    with pytest.raises(ValueError, match="does not stand for bytes, which its model was trained on"):
        hf.read_hf(nag)

    module = tiny_module("nag", vocab_size=bpe.vocab_size)
    module.set_tokenizer(bpe)
    folder = export_checkpoint(str(save_like_fit(module, tmp_path / "bpe.ckpt")), str(tmp_path / "bpe"),
                               format="hf")
    other = json.loads(bpe.json_text)  # the same ids, two of them swapped
    vocab = other["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (folder / "tokenizer.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="is not the tokenizer its model was trained with"):
        hf.read_hf(folder)

    _, llama = exported(tmp_path, "prenorm")
    (llama / "tokenizer.json").write_text(bpe.json_text)  # ids up to 299 for a model of 256
    with pytest.raises(ValueError, match="beyond the model's vocabulary of 256 ids"):
        hf.read_hf(llama)


def test_missing_weights_and_pickles_are_refused_in_one_sentence(tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = exported(tmp_path, "nag", "threshold")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.blocks.1.mlp.compute.proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="holds no weight model.blocks.1.mlp.compute.proj.weight"):
        transformers.AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match="holds weights that do not fit"):
        hf.read_hf(folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="never from a pickle"):
        hf.read_hf(folder)


def test_a_config_that_names_code_is_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="names code by class path"):
        hf.NagLightningConfig(arch={"residual": "os.system"})


def test_the_export_command_writes_the_folder_and_says_when_transformers_is_missing(tmp_path, capsys,
                                                                                    monkeypatch):
    ckpt = save_like_fit(tiny_module("nag"), tmp_path / "last.ckpt")
    status, err = run_cli(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "a"), "--format",
                           "hf"], capsys)
    assert status == 0, err
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model_type"] == "nag_lightning"
    for name in [m for m in sys.modules if m.startswith("nag_lightning.hf")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    status, err = run_cli(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "b"), "--format",
                           "hf"], capsys)
    assert status == 1 and said_once(err, "pip install 'nag-lightning[hf]'"), err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("residual", ["prenorm", "nag"])
def test_nag_lightning_load_reads_a_transformers_folder_as_its_checkpoint(tmp_path, residual):
    """`nag_lightning.load` takes the folder `export --format hf` writes (a Llama folder for
    pre-norm, the package's model type for NAG) and gives the checkpoint's logits and text."""
    import nag_lightning

    router = "none" if residual == "prenorm" else "threshold"
    ckpt, folder = exported(tmp_path, residual, router)
    from_folder, from_ckpt = nag_lightning.load(folder), nag_lightning.load(ckpt)
    with torch.no_grad():
        torch.testing.assert_close(from_folder.model(IDS).logits, from_ckpt.model(IDS).logits,
                                   atol=1e-5, rtol=1e-5)
    assert from_folder.generate(PROMPT, max_new_tokens=6) == from_ckpt.generate(PROMPT, max_new_tokens=6)
    assert from_folder.tokenizer == from_ckpt.tokenizer


def test_a_transformers_folder_without_weights_is_refused_in_one_sentence(tmp_path):
    import nag_lightning

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="holds no model.safetensors"):
        nag_lightning.load(tmp_path)
