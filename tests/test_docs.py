"""docs/enable.md publishes only snippets that run: every code block is named, every name is run
by a test, and the snippets that need no launcher run here on every release."""

import re
from pathlib import Path

from megatron.core.models.gpt import gpt_layer_specs

from doc_snippets import ENABLE_MD, run_snippet, snippets
from mcore_torch_experts import TorchGroupedMLP
from test_specs import mlp_kinds, plain_config
from tiny_gpt import gpt, tiny_config

TESTS = Path(__file__).parent


def test_every_code_block_is_a_named_snippet():
    fences = ENABLE_MD.read_text().count("```")
    assert fences == 2 * len(snippets()), "a code block in docs/enable.md has no snippet name"


def test_every_snippet_is_run_by_a_test():
    sources = "".join(path.read_text() for path in TESTS.glob("*.py"))
    used = set(re.findall(r'(?:run_snippet|snippet)\("([\w-]+)"', sources))
    assert set(snippets()) <= used, f"not run by any test: {sorted(set(snippets()) - used)}"


def test_gpt_spec_snippet_builds_torch_experts(megatron_cpu):
    model = run_snippet("gpt-spec", config=plain_config(transformer_impl="local"))["model"]
    assert mlp_kinds(model)[1:] == [TorchGroupedMLP, TorchGroupedMLP]


def test_convert_snippet_converts_every_experts_module(megatron_cpu, capsys):
    config = tiny_config(moe_grouped_gemm=False)
    model = gpt(config, gpt_layer_specs.get_gpt_decoder_block_spec(config, False))
    summary = run_snippet("convert", model=model)["summary"]
    assert summary.modules_converted == 2
    assert mlp_kinds(model)[1:] == [TorchGroupedMLP, TorchGroupedMLP]
    assert capsys.readouterr().out.startswith(f"2 {summary.bytes_packed} ")
