"""The page's prompt box for text worlds, against a tiny Self-Forcing world served with a tiny
UMT5 text encoder: a typed prompt opens the world, Enter on a new one switches the running world
to it (`prompt`: the world goes on), Shift+Enter resets into one, and a prompt over the world's
text length is refused in words while the session goes on."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.fixtures.golden.served import write_self_forcing_dir, write_umt5_dir
from tests.web.browser.harness import ClientPage
from tests.web.conftest import serving_in_thread
from web import cli
from web.server import Server

pytestmark = pytest.mark.browser

OpenPage = Callable[..., ClientPage]
PLAYING = "s.status === 'playing'"


@pytest.fixture(scope="module")
def text_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pytest.importorskip("tokenizers")
    tmp = tmp_path_factory.mktemp("sf_text_page")
    (tmp / "umt5").mkdir()
    model, enc = write_self_forcing_dir(tmp), write_umt5_dir(tmp / "umt5")
    argv = ["serve", "--model", str(model), "--text-encoder", str(enc), "--device", "cpu"]
    args = cli._parser().parse_args(argv)
    with serving_in_thread(cli._load(args.model, args), default_model="self-forcing") as server:
        yield server


def test_a_typed_prompt_opens_and_resets_a_text_world(open_page: OpenPage, text_server: Server) -> None:
    page = open_page("?codec=raw&seed=3", base=text_server.url)
    page.wait("document.querySelectorAll('#model option').length > 0")
    assert page.page.is_visible("#prompt-box")
    page.page.fill("#prompt", "a red car on a beach")
    page.page.press("#prompt", "Enter")
    s = page.wait(f"{PLAYING} && s.chunk >= 1")
    session = text_server.manager.get(s["sessionId"])
    assert session.cond.prompt == "a red car on a beach" and s["prompt"] == "a red car on a beach"
    page.page.fill("#prompt", "a castle at night")
    page.page.press("#prompt", "Enter")  # a switch: the same world goes on under it
    s = page.wait("s.promptSwitches === 1")
    assert s["worlds"] == 1 and s["prompt"] == "a castle at night"
    assert text_server.manager.get(s["sessionId"]).cond.prompt == "a castle at night"
    page.page.fill("#prompt", "a red car on a beach")
    page.page.press("#prompt", "Shift+Enter")  # a fresh world with it
    s = page.wait("s.worlds === 2")
    assert text_server.manager.get(s["sessionId"]).cond.prompt == "a red car on a beach"
    page.page.fill("#prompt", "a long road " * 8)  # 25 tokens: this world takes 16
    page.page.press("#prompt", "Enter")
    s = page.wait("s.errors.length > 0")
    (error,) = s["errors"]
    assert error["code"] == "invalid_field" and not error["fatal"] and "at most 16" in error["message"], error
    assert "at most 16" in page.page.inner_text("#banner")
    went_on = text_server.manager.get(s["sessionId"])
    assert went_on.cond.prompt == "a red car on a beach"  # the session went on under its prompt
    page.wait(PLAYING)
    page.screenshot()
