"""What the OpenAI frontend reads of a served model, without a server: its chat template (tokenizer files,
config, the engine's tokenizer) and its LLM interface (tensors or typed requests, an ensemble's engine)."""

from __future__ import annotations

import json
from pathlib import Path

from tideserve.openai.chat_template import load_template, tokenizer_dir


class _Runtime:
    """A ServedModel as frontends read it; ``engine``: what its LLM backend tells of its engine."""

    def __init__(self, tmp_path: Path, config_text: str, name: str = "m", engine=None) -> None:
        from tideserve import config as config_module
        from tideserve.backend import ModelContext

        (tmp_path / name / "1").mkdir(parents=True, exist_ok=True)
        config = config_module.parse_text(f'name: "{name}"\n{config_text}')
        self.name = name
        self.ctx = ModelContext(name, 1, config, tmp_path / name)
        self.config = config
        self.engine = engine


def test_chat_template_found_in_tokenizer_files_and_config(tmp_path):
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": [{"name": "default", "template": "{{ bos_token }}D"}, {"name": "tool_use", "template": "T"}]}))
    runtime = _Runtime(tmp_path, f'backend: "python"\nparameters {{ key: "tokenizer_dir" value {{ string_value: '
                                 f'"{tokenizer}" }} }}')
    assert tokenizer_dir(runtime) == tokenizer.resolve()
    template = load_template(runtime)
    assert template.render([]) == "<s>D"
    assert template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    (tokenizer / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert load_template(runtime).render([]) == "J</s>"

    from tideserve.generation import EngineInfo

    vllm = _Runtime(tmp_path, 'backend: "vllm"', "llm", EngineInfo(typed_requests=True, tokenizer_dir=str(tokenizer)))
    assert load_template(vllm).render([]) == "J</s>"  # the tokenizer files its engine loaded

    inline = _Runtime(tmp_path, 'backend: "python"\nparameters { key: "chat_template" value { string_value: '
                                '"{% for m in messages %}{{ m.content }}{% endfor %}" } }', "inline")
    assert load_template(inline).render([{"role": "user", "content": "hi"}]) == "hi"
    assert load_template(_Runtime(tmp_path, 'backend: "python"', "bare")) is None


def test_llm_models_are_told_by_their_interface(tmp_path):
    from tideserve.openai.llm import describe

    text = 'input [{ name: "text_input" data_type: TYPE_STRING dims: [1] }, ' \
           '{ name: "sampling_parameters" data_type: TYPE_STRING dims: [1] }]\n' \
           'output [{ name: "text_output" data_type: TYPE_STRING dims: [-1] }]\n'
    steps = 'ensemble_scheduling { step [ { model_name: "pre" model_version: -1 input_map { key: "text_input" ' \
            'value: "text_input" } output_map { key: "ids" value: "_ids" } }, { model_name: "engine" ' \
            'model_version: -1 input_map { key: "input_ids" value: "_ids" } input_map { key: "sampling_parameters" ' \
            'value: "sampling_parameters" } output_map { key: "text_output" value: "text_output" } } ] }'
    from tideserve.generation import EngineInfo

    engine = EngineInfo(typed_requests=True, structured_outputs=True, token_prompts=True, max_model_len=512)
    steps_runtimes = {"pre": _Runtime(tmp_path, 'backend: "python"', "pre"),
                      "engine": _Runtime(tmp_path, 'backend: "vllm"', "engine", engine)}
    ensemble = describe(_Runtime(tmp_path, 'platform: "ensemble"\n' + text + steps, "ens"), steps_runtimes.__getitem__)
    assert ensemble.sampling_json and ensemble.structured_outputs and not ensemble.token_prompts
    assert not ensemble.typed and ensemble.max_model_len == 512  # tensors to the ensemble; its engine's context
    direct = describe(_Runtime(tmp_path, 'backend: "vllm"\n' + text, "direct", engine), None)
    assert direct.typed and direct.structured_outputs and direct.token_prompts
    generic = describe(_Runtime(tmp_path, 'backend: "python"\n' + text, "py"), None)
    assert generic.sampling_json and not generic.structured_outputs
    assert describe(_Runtime(tmp_path, 'backend: "python"\ninput [{ name: "x" data_type: TYPE_FP32 dims: [1] }]',
                             "other"), None) is None
