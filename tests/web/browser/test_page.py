"""The page at `/` in headless Chromium: it plays, takes input, pauses, resets, forks, survives a
dropped socket and decodes both H.264 (WebCodecs) and JPEG. Mirrors web/static/main.js."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.web.browser.harness import ClientPage, DropProxy, blank
from web.sdk import connect
from web.server import Server

pytestmark = pytest.mark.browser

OpenPage = Callable[..., ClientPage]
PLAYING = "s.status === 'playing'"


def h264_problem(page: ClientPage) -> str | None:
    """Why this Chromium cannot decode the H.264 the server sends, or None when it can."""
    return page.page.evaluate(
        "async () => (await import('/decoders.js')).h264Problem(window.__worldserve.codecString || undefined)"
    )


def test_autostart_plays_and_draws(open_page: OpenPage) -> None:
    page = open_page("?autostart=1&codec=jpeg&seed=1")
    s = page.wait(f"{PLAYING} && s.chunksShown >= 3")
    assert s["codec"] == "jpeg" and s["model"] == "smooth" and s["fallback"] is None
    assert not blank(page.pixels()), "the canvas is blank"
    page.wait("s.fps > 0")
    assert "playing" in page.hud("status")
    assert "JPEG" in page.hud("codec")
    assert "denoise" in page.hud("timings")
    page.screenshot()
    assert page.console == []


def test_holding_d_advances_actions_and_changes_the_picture(open_page: OpenPage) -> None:
    page = open_page("?autostart=1&codec=jpeg")
    before = page.wait(f"{PLAYING} && s.chunksShown >= 2")
    picture = page.pixels()
    page.page.keyboard.down("d")
    pressed = page.state()["lastActionSeq"]  # the action sent for the key press
    assert pressed > before["lastActionSeq"]
    page.run_for(1.0)
    held = page.state()
    page.page.keyboard.up("d")
    # actions repeat while the key is held (every 50 ms), not just on the press
    assert held["lastActionSeq"] >= pressed + 5, held
    s = page.wait(f"s.lastAppliedSeq !== null && s.lastAppliedSeq >= {pressed}")
    assert s["latencyMs"] is not None and s["latencyMs"] > 0
    assert page.pixels() != picture, "the picture did not change"
    assert "ms" in page.hud("latency")
    page.screenshot()


def test_pause_stops_chunks_and_resume_restarts_them(open_page: OpenPage) -> None:
    page = open_page("?autostart=1&codec=jpeg")
    page.wait(f"{PLAYING} && s.chunksShown >= 2")
    page.page.click("#pause")
    page.wait("s.status === 'paused'")
    page.run_for(1.0)  # a chunk in flight at the pause still arrives
    paused = page.state()
    page.run_for(1.0)
    later = page.state()
    assert later["chunksShown"] == paused["chunksShown"], "chunks were shown while paused"
    assert later["chunkReceived"] == paused["chunkReceived"], "chunks were generated while paused"
    assert page.page.inner_text("#pause") == "Resume"
    page.screenshot("paused")
    page.page.click("#pause")
    page.wait(f"{PLAYING} && s.chunksShown >= {later['chunksShown'] + 3}")


def test_cancel_is_answered(open_page: OpenPage) -> None:
    page = open_page("?autostart=1&codec=jpeg")
    page.wait(f"{PLAYING} && s.chunksShown >= 1")
    page.page.click("#cancel")
    s = page.wait("s.cancels === 1")
    assert s["errors"] == []
    page.wait(f"s.chunksShown >= {s['chunksShown'] + 2}")  # and the world goes on


def test_reset_gives_a_new_world(open_page: OpenPage) -> None:
    page = open_page("?autostart=1&codec=jpeg&seed=5")
    s = page.wait(f"{PLAYING} && s.chunksShown >= 3 && s.worlds === 1")
    page.page.fill("#seed", "6")
    page.page.click("#reset")
    s = page.wait("s.worlds === 2")
    reset_at = s["chunkReceived"]
    s = page.wait(f"s.chunk > {reset_at} + 1")
    assert s["sessionId"] and s["errors"] == []
    assert not blank(page.pixels())
    page.screenshot()


def test_back_steps_back_a_chunk_and_held_keeps_stepping(open_page: OpenPage) -> None:
    page = open_page("?autostart=1&codec=jpeg&seed=5")
    s = page.wait(f"{PLAYING} && s.chunksShown >= 6")
    page.page.click("#back")
    s = page.wait("s.rewinds === 1")
    assert s["rewoundTo"] >= 5 and s["errors"] == [] and s["worlds"] == 1
    page.wait(f"{PLAYING} && s.chunk > {s['rewoundTo']}")  # released: the world goes on from there
    box = page.page.locator("#back").bounding_box()
    assert box is not None
    page.page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.page.mouse.down()
    page.wait("s.rewinds >= 3", timeout_s=30)  # held: one chunk back after another
    page.page.mouse.up()
    s = page.state()
    assert s["errors"] == [] and s["rewoundTo"] >= 0
    page.wait(f"{PLAYING} && s.chunk > {s['rewoundTo']}")
    assert page.console == []


@pytest.mark.parametrize("codec", ["h264", "raw"])
def test_codec_renders(open_page: OpenPage, codec: str) -> None:
    page = open_page(f"?autostart=1&codec={codec}")
    s = page.wait(f"{PLAYING} && s.chunksShown >= 3")
    problem = h264_problem(page) if codec == "h264" else None
    if problem is None:
        assert s["codec"] == codec and s["fallback"] is None, s
        if codec == "h264":
            assert s["codecString"].startswith("avc1."), s
            assert "H.264" in page.hud("codec") and "WebCodecs" in page.hud("codec")
    else:  # this Chromium has no H.264: the page must say so and play JPEG
        assert s["codec"] == "jpeg" and s["fallback"], s
        assert "fallback" in page.hud("codec")
    page.wait(f"s.framesShown >= {s['framesShown'] + 4}")
    assert not blank(page.pixels())
    assert s["skipped"] == 0, s
    page.screenshot()
    assert page.console == []


def test_h264_falls_back_to_jpeg_without_webcodecs(open_page: OpenPage, browser: object) -> None:
    page = open_page()
    page.page.add_init_script("delete window.VideoDecoder;")  # as in a browser without WebCodecs
    page.page.goto(page.page.url.rstrip("/") + "/?autostart=1&codec=h264")
    s = page.wait(f"{PLAYING} && s.chunksShown >= 2")
    assert s["codec"] == "jpeg" and "WebCodecs" in s["fallback"], s
    assert "fallback" in page.hud("codec")
    assert page.page.is_visible("#banner")
    assert "JPEG" in page.page.inner_text("#banner")
    assert not blank(page.pixels())
    page.screenshot()


def test_reconnects_after_a_dropped_socket(open_page: OpenPage, proxy: DropProxy) -> None:
    page = open_page("?autostart=1&codec=h264", base=proxy.url)
    before = page.wait(f"{PLAYING} && s.chunksShown >= 3")
    assert proxy.drop() > 0
    s = page.wait(f"{PLAYING} && s.reconnects === 1 && s.chunksShown >= {before['chunksShown'] + 4}")
    assert s["sessionId"] == before["sessionId"] and s["resumeToken"] == before["resumeToken"]
    # every chunk shown once, none lost: the server re-sent what was unacked, the page deduplicated
    assert s["chunksShown"] == s["chunk"] and s["gaps"] == 0, s
    assert s["skipped"] == 0, s  # H.264 restarted cleanly at the new socket's keyframe
    assert s["errors"] == []
    assert not blank(page.pixels())
    page.screenshot()


def test_fork_opens_in_a_new_tab(open_page: OpenPage) -> None:
    page = open_page("?autostart=1&codec=jpeg")
    s = page.wait(f"{PLAYING} && s.chunksShown >= 2")
    with page.page.context.expect_page() as popup:
        page.page.click("#fork")
    fork = ClientPage(popup.value, page.name + "-fork")
    fork.page.wait_for_url("**/?resume=*")
    f = fork.wait(f"{PLAYING} && s.chunksShown >= 2")
    assert f["sessionId"] != s["sessionId"]
    assert f["resumeToken"] in page.state()["forks"]
    assert f["chunk"] > s["chunk"] - 1  # the copy goes on from the source's position
    fork.screenshot()


def test_server_errors_are_shown_in_words(open_page: OpenPage) -> None:
    page = open_page("?autostart=1&codec=jpeg&model=no-such-world")
    s = page.wait("s.errors.length > 0 && s.status === 'failed'")
    (error,) = s["errors"]
    assert error["code"] == "not_found" and error["fatal"]
    assert "does not exist" in error["text"]
    assert page.page.is_visible("#banner")
    assert "does not exist" in page.page.inner_text("#banner")
    # the server was reached and said no: the HUD says what it said, not that it was unreachable
    status = page.hud("status")
    assert "does not exist" in status and "no-such-world" in status and "reach" not in status, status
    page.screenshot()


def test_an_open_refused_with_invalid_field_ends_the_attempt_in_words(open_page: OpenPage) -> None:
    page = open_page(f"?autostart=1&codec=jpeg&model={'x' * 200}")  # longer than a model id may be
    s = page.wait("s.status === 'failed'")
    (error,) = s["errors"]
    assert error["code"] == "invalid_field" and not error["fatal"] and error["message"].startswith("model:")
    status = page.hud("status")
    assert "turned down" in status and "model:" in status and "reach" not in status, status
    banner = page.page.inner_text("#banner")
    assert "model:" in banner and "press Start" in banner, banner
    page.run_for(0.5)
    assert page.state()["status"] == "failed"  # not retried, not back to "connecting"
    page.screenshot()


def test_an_unknown_codec_in_the_address_is_reported(open_page: OpenPage) -> None:
    page = open_page("?codec=vp9")
    page.page.wait_for_selector("#model option", state="attached")
    assert page.page.is_visible("#banner")
    banner = page.page.inner_text("#banner")
    assert '"vp9"' in banner and "h264" in banner, banner
    s = page.state()
    assert "vp9" in s["codecProblem"], s
    assert "vp9" in page.hud("codec")
    page.page.click("#overlay")  # the session still starts, in the picker's codec
    s = page.wait(f"{PLAYING} && s.chunksShown >= 1")
    assert s["codec"] in ("h264", "jpeg") and "vp9" in page.hud("codec")


def test_models_picker_lists_the_server_models(open_page: OpenPage) -> None:
    page = open_page()
    page.page.wait_for_selector("#model option", state="attached")
    options = page.page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
    assert sorted(options) == ["smooth", "tiny", "tiny-image"]
    assert page.page.input_value("#model") == "smooth"  # the server's default
    assert page.page.is_visible("#overlay")  # no autostart: waits for a click
    assert page.state()["status"] == "idle"
    page.page.select_option("#model", "tiny-image")
    page.page.click("#overlay")
    s = page.wait(f"{PLAYING} && s.chunksShown >= 3")
    assert s["model"] == "tiny-image"


def test_ready_frame_is_drawn_before_any_chunk(open_page: OpenPage, server: Server) -> None:
    async def lockstep_session() -> tuple[str, np.ndarray]:
        s = await connect(server.url, model="tiny-image", seed=4, mode="lockstep", codec="raw")
        frames = await s.step({"keys": ["d"]})
        await s.disconnect()  # detached, not closed: the page attaches to it
        return s.ready.resume_token, frames[-1]

    with ThreadPoolExecutor(1) as pool:  # Playwright's sync API holds this thread's event loop
        token, last = pool.submit(asyncio.run, lockstep_session()).result(60)
    page = open_page(f"?resume={token}&codec=raw")  # a lockstep world: no chunk comes by itself
    s = page.wait(f"{PLAYING} && s.stillsShown === 1")
    assert s["chunksShown"] == 0 and s["framesShown"] == 0, s
    rgba = np.frombuffer(page.pixels(), np.uint8).reshape(32, 32, 4)
    assert np.abs(rgba[..., :3].astype(int) - last.astype(int)).max() <= 2  # the latest committed frame
    page.screenshot()


def test_mouse_moves_are_sent_under_pointer_lock(open_page: OpenPage) -> None:
    page = open_page("?autostart=1&codec=jpeg")
    page.wait(f"{PLAYING} && s.chunksShown >= 1")
    assert page.page.is_visible("#mouse-help")  # the hint shows for worlds that take the mouse
    page.page.click("#screen")  # the model takes the mouse: a click locks the pointer
    page.page.wait_for_function("() => document.pointerLockElement === document.getElementById('screen')")
    page.page.mouse.move(400, 300, steps=5)
    page.page.mouse.move(420, 340, steps=5)
    s = page.wait("s.mouseSent > 0")
    assert s["errors"] == []


def test_codec_can_be_switched_while_playing(open_page: OpenPage) -> None:
    page = open_page("?autostart=1&codec=jpeg")
    s = page.wait(f"{PLAYING} && s.chunksShown >= 2")
    want = "h264" if h264_problem(page) is None else "raw"
    page.page.select_option("#codec", want)  # the session goes on over a new socket in that codec
    s = page.wait(f"{PLAYING} && s.codec === '{want}' && s.chunksShown >= {s['chunksShown'] + 3}")
    page.page.select_option("#codec", "jpeg")
    s = page.wait(f"{PLAYING} && s.codec === 'jpeg' && s.chunksShown >= {s['chunksShown'] + 3}")
    assert s["chunksShown"] == s["chunk"] and s["gaps"] == 0 and s["skipped"] == 0, s
    assert s["worlds"] == 1 and s["errors"] == []


def models_listed(page: ClientPage) -> None:
    """Wait for the page to list /v1/models (it knows which worlds take a start image from it)."""
    page.page.wait_for_function("() => document.getElementById('model').options.length > 0")


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A solid-colour PNG."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), rgb).save(out, format="PNG")
    return out.getvalue()


def test_a_picked_start_image_is_sent_with_open_and_kept_by_reset(
    open_page: OpenPage, server: Server
) -> None:
    page = open_page("?model=tiny-image&codec=raw&seed=3")
    models_listed(page)
    assert page.page.is_visible("#image-picker")  # tiny-image starts from an image
    colour = (200, 40, 90)
    page.page.set_input_files(
        "#start-image", files=[{"name": "red.png", "mimeType": "image/png", "buffer": png(200, 120, colour)}]
    )
    page.page.click("#start")
    s = page.wait(f"{PLAYING} && s.stillsShown >= 1")
    # downscaled on the page to the world's frame size (tiny-image takes no other size)
    assert s["startImage"] == {"name": "red.png", "width": 32, "height": 32}, s
    cond = server.manager.get(s["sessionId"]).cond.image
    assert cond is not None and cond.shape == (32, 32, 3)
    assert (cond == np.array(colour, np.uint8)).all(), cond[0, 0]
    page.page.click("#reset")
    s = page.wait("s.worlds === 2")
    assert (server.manager.get(s["sessionId"]).cond.image == np.array(colour, np.uint8)).all()
    assert s["errors"] == [], s


def test_a_start_image_that_is_not_a_picture_is_refused_on_the_page(open_page: OpenPage) -> None:
    page = open_page("?model=tiny-image&codec=raw")
    models_listed(page)
    sockets: list[str] = []
    page.page.on("websocket", lambda ws: sockets.append(ws.url))
    page.page.set_input_files(
        "#start-image", files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"not a picture"}]
    )
    page.page.click("#start")
    s = page.wait("s.imageProblem !== null")
    assert "notes.txt" in s["imageProblem"] and "could not be read" in s["imageProblem"], s
    assert page.page.is_visible("#banner") and "notes.txt" in page.page.inner_text("#banner")
    assert s["status"] == "idle" and s["startImage"] is None and sockets == [], s


def test_worlds_that_are_not_image_started_have_no_picker(open_page: OpenPage) -> None:
    page = open_page("?model=smooth")
    models_listed(page)
    assert not page.page.is_visible("#image-picker")
    page.page.select_option("#model", "tiny-image")
    assert page.page.is_visible("#image-picker")
    assert not page.page.is_visible("#prompt-box")  # no world here takes text


@pytest.mark.parametrize(
    ("address", "words"),
    [("/missing.png", "could not be fetched"), ("http://example.invalid/a.png", "must be on this server")],
)
def test_an_image_address_that_cannot_be_used_is_reported(
    open_page: OpenPage, address: str, words: str
) -> None:
    page = open_page(f"?model=tiny-image&image={address}")
    models_listed(page)
    page.page.click("#start")
    s = page.wait("s.imageProblem !== null")
    assert words in s["imageProblem"] and s["status"] == "idle", s
