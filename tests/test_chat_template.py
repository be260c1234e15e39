"""`--chat-template FILE`: a bundle without a template answers chat with a 400 that names the
fix; the flag gives one at serve time (in place of the bundle's) or at build time (stored)."""

from __future__ import annotations

import json

import openai
import pytest
from click.testing import CliRunner
from servers import client, serving, wait_healthy

from specrt.bundle import Bundle
from specrt.cli import cli
from specrt.errors import SpecrtError
from specrt.runtime import SpeculativeRuntime
from specrt.runtime.text import read_template
from specrt.serve import ServeSettings

# A template of our own, recognisable in the prompt it renders.
TEMPLATE = (
    "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>> {% endif %}"
)
ASK = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture
def without_template(bundle_copy):
    """The llama bundle as a GGUF without a template builds it: no chat template."""
    manifest = bundle_copy / "manifest.json"
    data = json.loads(manifest.read_text())
    data["chat_template"] = None
    manifest.write_text(json.dumps(data))
    return bundle_copy


def test_no_template_is_a_400_that_names_the_fix_and_the_flag_supplies_one(
    without_template, template_file
):
    settings = ServeSettings(bundle=without_template, model_name="tiny", calibrate=False)
    with serving(settings) as (base, _):
        wait_healthy(base)
        with pytest.raises(openai.BadRequestError, match="--chat-template FILE"):
            client(base).chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
    given = ServeSettings(
        bundle=without_template, model_name="tiny", calibrate=False, chat_template=template_file
    )
    with serving(given) as (base, _):
        wait_healthy(base)
        reply = client(base).chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
    rt = SpeculativeRuntime.load(without_template, calibrate=False, chat_template=TEMPLATE)
    rendered = rt.tokenizer.render_chat(ASK)
    assert rendered == "<<user>> Say something.\n<<assistant>> "
    assert reply.usage.prompt_tokens == len(rt.tokenizer.encode(rendered))


def test_build_stores_the_template_given(pairs, template_file, tmp_path):
    draft, target = pairs["llama"]
    out = tmp_path / "b"
    args = ["build", "--draft", str(draft), "--target", str(target), "--out", str(out)]
    args += ["--max-context", "64", "--chat-template", str(template_file)]
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 0, done.output
    assert Bundle.load(out).manifest["chat_template"] == TEMPLATE


def test_a_bad_template_file_is_refused_by_name(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(SpecrtError, match="broken.jinja: not a Jinja template"):
        read_template(broken)
    with pytest.raises(SpecrtError, match="missing.jinja: cannot read it"):
        read_template(tmp_path / "missing.jinja")
    with pytest.raises(SpecrtError, match="not a Jinja template"):
        ServeSettings(bundle=tmp_path, chat_template=broken).template()
