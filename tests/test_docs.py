"""The published pages (README.md, docs/*.md) show only code that runs: every code block is
named, every name is run by a test, and the snippets that need no launcher run here on every
release."""

import re
import shlex
from pathlib import Path

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs

from mcore_torch_experts import TorchGroupedMLP, apply_lora, build_gpt_model
from support.doc_snippets import PUBLISHED, README_MD, code_blocks, run_snippet, snippet, snippets
from support.specs import experts_class, mlp_kinds, plain_config
from support.te import needs_te
from support.tiny_gpt import fp32_moe_config, gpt, tiny_config

TESTS = Path(__file__).parent
REPO = TESTS.parent


@pytest.mark.parametrize("doc", PUBLISHED, ids=lambda doc: doc.name)
def test_every_code_block_is_a_named_snippet(doc):
    assert code_blocks(doc) == len(snippets(doc)), f"a code block in {doc.name} has no snippet name"


def test_snippet_names_are_unique_across_the_pages():
    names = [name for doc in PUBLISHED for name in snippets(doc)]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


def test_every_snippet_is_run_by_a_test():
    sources = "".join(path.read_text() for path in TESTS.rglob("*.py")
                      if "third_party" not in path.parts)
    used = set(re.findall(r'(?:run_snippet|snippet)\("([\w-]+)"', sources))
    published = {name for doc in PUBLISHED for name in snippets(doc)}
    assert published <= used, f"not run by any test: {sorted(published - used)}"


def test_readme_commands_are_the_scripts_ci_runs():
    commands = [shlex.split(line) for line in snippet("readme-commands", README_MD).splitlines()]
    scripts = [words[1] for words in commands if words[:1] == ["bash"]]
    assert scripts == ["scripts/run_example.sh", "scripts/run_tests.sh"]
    assert all((REPO / script).is_file() for script in scripts)
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == ["bash scripts/run_tests.sh"], "CI must run the README's test command, only it"


@pytest.mark.te
@needs_te[1]
@needs_te[2]
def test_readme_flag_snippet_gives_torch_experts(te_world):
    """Megatron's TE layer spec, which the snippet names, needs Transformer Engine to build."""
    spec = run_snippet("readme-flag", README_MD)["layer_spec"]
    assert experts_class(spec) is TorchGroupedMLP


def test_guarantees_lora_snippet_saves_and_strictly_reloads_the_adapters(
        megatron_cpu_training, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = fp32_moe_config(num_layers=2)
    torch.manual_seed(1)
    other = build_gpt_model(config, vocab_size=32000, max_sequence_length=4096)
    apply_lora(other, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], rank=16,
               alpha=32, expert_adapter="per_expert", dtype=torch.float32)
    torch.manual_seed(2)
    namespace = run_snippet("lora", REPO / "docs" / "guarantees.md", torch=torch,
                            config=config, other_model_with_lora=other)
    saved = torch.load(tmp_path / "adapters.pt")
    adapters = {name: p for name, p in namespace["model"].named_parameters() if p.requires_grad}
    assert adapters and set(adapters) == set(saved)
    loaded = dict(other.named_parameters())
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    assert any(not torch.equal(value, torch.zeros_like(value)) for value in saved.values())


def test_gpt_spec_snippet_builds_torch_experts(megatron_cpu):
    model = run_snippet("gpt-spec", config=plain_config(transformer_impl="local"))["model"]
    assert mlp_kinds(model)[1:] == [TorchGroupedMLP, TorchGroupedMLP]


def test_spec_functions_snippet_and_table_name_every_public_spec_function():
    """docs/specs.md imports and tabulates exactly `mcore_torch_experts.specs.__all__`, each the
    package's own function."""
    from mcore_torch_experts import specs

    page = REPO / "docs" / "specs.md"
    namespace = run_snippet("spec-functions", page)
    imported = {name for name, value in namespace.items() if callable(value)}
    assert imported == set(specs.__all__)
    assert all(namespace[name] is getattr(specs, name) for name in imported)
    table = [line for line in page.read_text().splitlines() if line.startswith("| `")]
    tabulated = {name for line in table for name in re.findall(r"`(\w+)(?:\(|`)",
                                                              line.split(" | ")[0])}
    assert tabulated == set(specs.__all__)


def test_convert_snippet_converts_every_experts_module(megatron_cpu, capsys):
    config = tiny_config(moe_grouped_gemm=False)
    model = gpt(config, gpt_layer_specs.get_gpt_decoder_block_spec(config, False))
    summary = run_snippet("convert", model=model)["summary"]
    assert summary.modules_converted == 2
    assert mlp_kinds(model)[1:] == [TorchGroupedMLP, TorchGroupedMLP]
    assert capsys.readouterr().out.startswith(f"2 {summary.bytes_packed} ")
