"""Chat templates without a server: rendered as Hugging Face renders them, their errors, and the render budget
that stops hostile templates."""

from __future__ import annotations

import time

import pytest
from openai_fixtures import TEMPLATE

from tideserve.openai.chat_template import ChatTemplate


def test_chat_template_renders_like_hugging_face():
    template = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m.role }}={{ m.content | tojson }}\n"
                            "{% endfor %}{% if tools %}{{ tools | length }} tools{% endif %}"
                            "{% if add_generation_prompt %}>{% endif %}", {"bos_token": "<s>"}, "test")
    messages = [{"role": "user", "content": "héllo"}]
    assert template.render(messages) == '<s>user="héllo"\n>'
    assert template.render(messages, tools=[{"type": "function"}], add_generation_prompt=False) == \
        '<s>user="héllo"\n1 tools'
    cont = ChatTemplate(TEMPLATE, {}, "test")
    assert cont.render([{"role": "assistant", "content": "Once upon"}], continue_final_message=True) == \
        "assistant: Once upon"


def test_chat_template_errors_are_template_errors():
    from tideserve.openai.chat_template import TemplateError

    template = ChatTemplate("{{ raise_exception('no system messages') }}", {}, "test")
    with pytest.raises(TemplateError, match="no system messages"):
        template.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("source, says", [
    ("{% for i in range(10**9) %}x{% endfor %}", "arguments above"),
    ("{{ 'x' * 10**9 }}", "built a value"),
    ("{{ 'x'|center(10**9) }}", "arguments above"),
    ("{{ 'x'.ljust(10**9) }}", "arguments above"),
    ("{{ '%1000000000s' % 'x' }}", "width"),
    ("{{ '{:>1000000000}'.format('x') }}", "width"),
    ("{{ '{:>{}}'.format('x', 10**9) }}", "arguments above"),
    ("{{ '%*s' % (10**9, 'x') }}", "arguments above"),
    ("{{ 7 ** 100000 }}", "too large a number"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "built a value"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran for more than"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "built a prompt"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
])
def test_chat_template_bombs_stop_within_the_budget(source, says):
    from tideserve.openai.chat_template import TemplateError
    from tideserve.openai.chat_template import RenderBudget

    start = time.monotonic()
    with pytest.raises(TemplateError, match=says):
        ChatTemplate(source, {}, "request").render([], budget=RenderBudget(0.5, 1 << 20))
    assert time.monotonic() - start < 10  # generous: the budget is 0.5 s


def test_a_template_within_the_budget_renders_as_without_one():
    from tideserve.openai.chat_template import RenderBudget

    source = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ m.role ~ ':' ~ " \
             "m.content|trim|tojson }}{{ '%02d' % loop.index }}{% endfor %}{{ ns.n }}{{ '{:>4}'.format(2 ** 10) }}" \
             "{{ '{}'.format(1700000000) }}"
    template = ChatTemplate(source, {}, "test")
    messages = [{"role": "user", "content": " a "}, {"role": "assistant", "content": "b"}]
    assert template.render(messages, budget=RenderBudget(2, 1000)) == template.render(messages) == \
        'user:"a"01assistant:"b"02210241700000000'
