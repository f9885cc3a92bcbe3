"""The chat page (/) and the cache view (/cache) in a real browser: headless Chromium (Debian's
package, installed by ``make test``) driven by Playwright, against ``prefixkv serve`` on the embedded
SmolLM2-135M-Instruct, started as a user starts it.

The page's requests are greedy (temperature 0 in its settings), so what the page shows is checked
against what the API answers for the same conversation."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from test_server import metrics as server_metrics  # /metrics as {name: value}, from a server's url

pytestmark = [pytest.mark.slow, pytest.mark.browser]

playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect

KEY = "sk-browser-test"
PHONE_WIDTH = 390
STATS = re.compile(r"^(\d+) tokens · TTFT [\d.]+ s · [\d.]+ tok/s · (\d+) cached$")


def chromium_path() -> str:
    path = os.environ.get("PREFIXKV_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("no Chromium: `make test` installs Debian's chromium package (apt-get install chromium)")
        pytest.skip("no Chromium on PATH (`make test` installs it; or set PREFIXKV_CHROMIUM)")
    return path


class Served:
    """``prefixkv serve`` in a subprocess on a free port; its output kept for failure messages."""

    def __init__(self, *args: str) -> None:
        exe = Path(sys.executable).with_name("prefixkv")
        cmd = [str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else ["-m", "prefixkv.cli"]),
               "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        ready = threading.Event()
        self.url = ""

        def drain() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.match(r"prefixkv serving \S+ at (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(180) or not self.url:
            self.stop()
            raise RuntimeError("prefixkv serve did not start:\n" + "".join(self.lines[-40:]))

    def metrics(self) -> dict[str, float]:
        return server_metrics(self)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    srv = Served()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    pg = context.new_page()
    pg.errors = []
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    yield pg
    context.close()
    assert not pg.errors, pg.errors  # no uncaught script error on the page


def wait_until(cond, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def settings(pg, temperature: str = "0", max_tokens: str = "40") -> None:
    """Fill the settings panel (opened if closed), then close it."""
    if not pg.locator("#temperature").is_visible():
        pg.click("#settings summary")
    pg.fill("#temperature", temperature)
    pg.fill("#max-tokens", max_tokens)
    pg.dispatch_event("#max-tokens", "change")
    pg.click("#settings summary")


def say(pg, text: str) -> None:
    pg.fill("#input", text)
    pg.press("#input", "Enter")


def answers(pg):
    return pg.locator(".msg.assistant")


def wait_answer(pg, n: int, timeout: float = 60_000) -> str:
    """The n-th answer (1-based) once its stream ended: its stats line."""
    done = pg.locator(".msg.assistant:not(.streaming) .stats")
    expect(done).to_have_count(n, timeout=timeout)
    return done.nth(n - 1).inner_text()


def api_answer(server: Served, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    """The API's greedy answer to the same conversation: (text, completion tokens)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
    return out.choices[0].message.content, out.usage.completion_tokens


def test_chat_streams_an_answer_and_the_second_turn_hits_the_cache(server, page):
    page.goto(server.url + "/")
    expect(page.locator("#model-name")).to_have_text("SmolLM2-135M-Instruct")
    assert page.evaluate("document.activeElement.id") == "input"  # type at once
    settings(page)
    # record the answer's text as it grows, to see it stream
    page.evaluate("""() => {
        window.seen = [];
        new MutationObserver(() => {
            const c = document.querySelector('.msg.assistant.streaming .content');
            if (c) window.seen.push(c.textContent.trim());
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    q1, q2 = "What is the capital of France?", "And of Germany?"
    say(page, q1)
    stats1 = wait_answer(page, 1)
    seen = [s for s in page.evaluate("window.seen") if s]
    a1 = answers(page).nth(0).locator(".content").inner_text()
    assert len(set(seen)) >= 3, seen  # several partial texts before the end
    assert all(a1.startswith(s) for s in seen), (seen, a1)
    m1 = STATS.match(stats1)
    assert m1, stats1
    assert (a1, int(m1.group(1))) == api_answer(server, [{"role": "user", "content": q1}], 40)
    say(page, q2)
    stats2 = wait_answer(page, 2)
    m2 = STATS.match(stats2)
    assert m2, stats2
    assert int(m2.group(2)) > 0  # the first turn's blocks were reused
    a2 = answers(page).nth(1).locator(".content").inner_text()
    history = [{"role": "user", "content": q1}, {"role": "assistant", "content": a1}, {"role": "user", "content": q2}]
    assert (a2, int(m2.group(1))) == api_answer(server, history, 40)

    # conversations persist in localStorage, and switch
    page.reload()
    expect(page.locator(".msg")).to_have_count(4)
    expect(page.locator("#conversations .conv")).to_have_text([q1])
    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)
    expect(page.locator("#conversations .conv")).to_have_count(2)
    page.locator("#conversations .conv", has_text=q1).click()
    expect(answers(page).nth(1).locator(".content")).to_have_text(a2)
    # delete the empty one: the chat stays
    page.locator("#conversations .delete").first.click()
    expect(page.locator("#conversations .conv")).to_have_text([q1])


def test_stop_aborts_the_request_and_the_server_frees_its_blocks(server, page):
    page.goto(server.url + "/")
    settings(page, max_tokens="2000")
    say(page, "Write a very long story about a dragon.")
    content = answers(page).nth(0).locator(".content")
    wait_until(lambda: len(content.inner_text()) > 60, 60, "the story to start")
    m = server.metrics()
    assert m["prefixkv_num_requests_running"] == 1 and m["prefixkv_kv_blocks_used"] > 0
    page.click("#stop")
    stats = wait_answer(page, 1)
    assert stats.endswith("· stopped"), stats
    wait_until(lambda: server.metrics()["prefixkv_kv_blocks_used"] == 0, 10, "the blocks to be freed")
    m = server.metrics()
    assert m["prefixkv_num_requests_running"] == 0 and m["prefixkv_kv_blocks_evictable"] > 0
    text = content.inner_text()
    time.sleep(0.5)
    assert content.inner_text() == text  # nothing more arrives
    m = re.match(r"^~(\d+) tokens · ", stats)  # no usage chunk after a stop: chunks counted, "~"
    assert m and 0 < int(m.group(1)) < 2000, stats
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()


def test_html_in_a_reply_renders_as_text(server, browser):
    # without the page's Content-Security-Policy: the renderer alone must keep the HTML inert
    context = browser.new_context(bypass_csp=True)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: (errors.append("dialog: " + d.message), d.dismiss()))
    page.goto(server.url + "/")
    settings(page, max_tokens="30")
    for i, prompt in enumerate(("Echo: <script>window.pwned=1</script>", "Echo: <img src=x onerror=window.pwned=1>",
                                "Write the HTML tag that starts a JavaScript block, in a code block.")):
        page.click("#new-chat")  # each prompt alone, as the API is asked
        say(page, prompt)
        wait_answer(page, 1)
        reply = api_answer(server, [{"role": "user", "content": prompt}], 30)[0]
        shown = answers(page).nth(0).locator(".content")
        if i == 0:  # the model echoes a raw <script> element, outside any code block
            assert "<script>window.pwned=1</script>" in reply
            assert "<script>window.pwned=1</script>" in shown.inner_text()
        elif i == 1:
            assert "<img src=x onerror=window.pwned=1>" in reply
            assert "<img src=x onerror=window.pwned=1>" in shown.inner_text()
        else:  # in a fenced block: code, shown as written
            assert "```" in reply and "<script>" in reply
            assert "<script>" in shown.locator("pre code").inner_text()
        expect(page.locator(".msg.user .content")).to_have_text(prompt)  # the user's own text, as text
        assert page.locator("#messages script, #messages img, #messages [onerror]").count() == 0
    assert page.evaluate("window.pwned") is None
    assert not errors, errors
    context.close()


HOSTILE = [
    "<script>window.pwned=1</script>",
    "<img src=x onerror=window.pwned=1>",
    "[click](javascript:window.pwned=1)",
    "![x](javascript:window.pwned=1)",
    '<a href="javascript:window.pwned=1">a</a>',
    "- item <svg onload=window.pwned=1></svg>\n- <iframe src=javascript:window.pwned=1></iframe>",
    '<div style="background:url(javascript:1)" onclick="window.pwned=1">x</div>',
    "```html\n<script>window.pwned=1</script>\n```",
    "<details open ontoggle=window.pwned=1>d</details>",
]


def test_the_renderer_keeps_hostile_markdown_inert(server, browser):
    """The page's own renderMarkdown on fixed hostile replies (no model needed), with the CSP off:
    no element runs script, no javascript: URL survives, the markup reads as text."""
    context = browser.new_context(bypass_csp=True)
    page = context.new_page()
    page.goto(server.url + "/")
    for text in HOSTILE:
        found = page.evaluate("""(text) => {
            const box = document.createElement('div');
            renderMarkdown(box, text);
            document.body.append(box);
            const bad = [];
            for (const e of box.querySelectorAll('*')) {
                if (['SCRIPT', 'IFRAME', 'SVG', 'OBJECT', 'EMBED', 'STYLE'].includes(e.tagName.toUpperCase()))
                    bad.push(e.tagName);
                for (const a of e.attributes) {
                    if (a.name.startsWith('on') || a.name === 'style' || /^\\s*javascript:/i.test(a.value))
                        bad.push(e.tagName + ' ' + a.name + '=' + a.value);
                }
            }
            return {bad, text: box.textContent, html: box.innerHTML};
        }""", text)
        assert found["bad"] == [], (text, found)
        if "```" not in text and "](" not in text:  # raw HTML: shown as the characters it is
            assert text.replace("- ", "").replace("\n", "") in found["text"].replace("\n", ""), (text, found)
    page.wait_for_timeout(200)
    assert page.evaluate("window.pwned") is None
    shown = page.evaluate("(t) => { const b = document.createElement('div'); renderMarkdown(b, t); return b.textContent; }",
                          "Echo: <b>hi</b> & <script>x</script>")
    assert shown.strip() == "Echo: <b>hi</b> & <script>x</script>"
    context.close()


def test_api_key_is_asked_for_and_sent_only_in_a_header(browser):
    srv = Served("--api-key", KEY)
    try:
        context = browser.new_context()
        page = context.new_page()
        requests = []
        page.on("request", lambda r: requests.append((r.url, r.headers.get("authorization"))))
        page.goto(srv.url + "/")
        dialog = page.locator("#key-dialog")
        expect(dialog).to_be_visible()
        page.fill("#key-input", KEY)
        page.press("#key-input", "Enter")
        expect(dialog).to_be_hidden()
        expect(page.locator("#model-name")).to_have_text("SmolLM2-135M-Instruct")
        page.click("#settings summary")
        page.fill("#system-prompt", "Be brief.")
        page.fill("#top-p", "0.9")
        page.fill("#seed", "7")
        settings(page, max_tokens="8")
        with page.expect_request("**/v1/chat/completions") as sent:
            say(page, "Hi!")
        assert json.loads(sent.value.post_data) == {
            "model": "SmolLM2-135M-Instruct", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
            "temperature": 0, "top_p": 0.9, "max_tokens": 8, "seed": 7}
        assert STATS.match(wait_answer(page, 1))
        assert all(KEY not in url for url, _ in requests), requests
        api = [(u, h) for u, h in requests if "/v1/" in u]
        # the first call had no key (401: the page asked); every later one sends it
        assert api[0] == (srv.url + "/v1/models", None), api
        assert len(api) >= 3 and all(h == f"Bearer {KEY}" for _, h in api[1:]), api
        # the cache view in the same browser uses the stored key
        page.goto(srv.url + "/cache")
        expect(page.locator("#status")).to_contain_text("Live", timeout=10_000)
        expect(page.locator("#key-dialog")).to_be_hidden()
        context.close()
    finally:
        srv.stop()


def test_cache_view_shows_blocks_in_use_change_while_a_request_runs(server, browser):
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    view, chat = context.new_page(), context.new_page()
    view.goto(server.url + "/cache")
    expect(view.locator("#status")).to_contain_text("Live", timeout=10_000)
    expect(view.locator("#stat-running")).to_have_text("0")
    expect(view.locator("#stat-in-use")).to_have_text("0")
    chat.goto(server.url + "/")
    settings(chat, max_tokens="2000")
    say(chat, "Write a very long story about a dragon named Zorath.")
    expect(view.locator("#stat-running")).to_have_text("1", timeout=30_000)
    first = wait_until(lambda: int(view.locator("#stat-in-use").inner_text() or 0), 30, "blocks in use")
    assert first > 0
    # the request's run in the tree, held by one request; its growth shows as more blocks in use
    expect(view.locator(".node-label", has_text="· 1 request ·").first).to_be_visible(timeout=10_000)
    wait_until(lambda: int(view.locator("#stat-in-use").inner_text()) >= first + 2, 60, "the request to grow")
    chat.keyboard.press("Escape")  # the chat page stops it from the keyboard
    expect(chat.locator(".msg.assistant .stats")).to_contain_text("stopped", timeout=10_000)
    expect(view.locator("#stat-running")).to_have_text("0", timeout=10_000)
    expect(view.locator("#stat-in-use")).to_have_text("0", timeout=10_000)
    assert int(view.locator("#stat-cached").inner_text()) > 0
    assert view.locator(".node-text").count() == 0  # no prompt text without --cache-view-text
    assert "%" in view.locator("#stat-hit-total").inner_text()
    assert view.locator("#history polyline.line-in-use").count() == 1
    context.close()


@pytest.mark.parametrize("path", ["/", "/cache"])
def test_pages_fit_a_phone_screen(server, browser, path):
    context = browser.new_context(viewport={"width": PHONE_WIDTH, "height": 844}, is_mobile=True, has_touch=True)
    page = context.new_page()
    page.goto(server.url + path)
    page.wait_for_timeout(600)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE_WIDTH, width  # nothing wider than the screen
    if path == "/":
        expect(page.locator("#sidebar")).to_be_hidden()
        expect(page.locator("#input")).to_be_visible()
        expect(page.locator("#send")).to_be_visible()
        page.click("#toggle-sidebar")
        expect(page.locator("#sidebar")).to_be_visible()
        expect(page.locator("#toggle-sidebar")).to_have_attribute("aria-expanded", "true")
        # the keyboard alone: the open sidebar has focus on "New chat"; Escape closes it and
        # returns to its button; Enter opens it again and Enter on "New chat" starts a chat
        assert page.evaluate("document.activeElement.id") == "new-chat"
        page.keyboard.press("Escape")
        expect(page.locator("#sidebar")).to_be_hidden()
        assert page.evaluate("document.activeElement.id") == "toggle-sidebar"
        page.keyboard.press("Enter")
        expect(page.locator("#sidebar")).to_be_visible()
        page.keyboard.press("Enter")
        expect(page.locator("#sidebar")).to_be_hidden()
        assert page.evaluate("document.activeElement.id") == "input"
    else:
        expect(page.locator("#status")).to_contain_text("Live", timeout=10_000)
        expect(page.locator("#tiers .tier")).to_have_count(1)
        # a deep tree whose children are longer than their parents still fits
        long = " ".join(f"word{i}" for i in range(150))
        for tail in ("first", "second"):
            api_answer(server, [{"role": "system", "content": "You are a helpful assistant. " * 6},
                                {"role": "user", "content": f"{tail} {long}"}], 1)
        page.wait_for_timeout(600)
        assert page.locator("#tree .node").count() >= 3
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE_WIDTH, width
    context.close()


def test_switching_reloading_and_deleting_while_an_answer_streams(server, page):
    page.goto(server.url + "/")
    settings(page, max_tokens="2000")
    say(page, "Write a very long story about a dragon.")
    content = answers(page).nth(0).locator(".content")
    wait_until(lambda: len(content.inner_text()) > 40, 60, "the story to start")
    page.click("#new-chat")  # away and back: the answer kept streaming meanwhile
    expect(page.locator(".msg")).to_have_count(0)
    saved = ("localStorage.getItem(Object.keys(localStorage).find(k => k.startsWith('prefixkv.conv.') "
             "&& localStorage.getItem(k).includes('dragon')))")  # the conversation as stored
    n = len(page.evaluate(saved))
    page.locator("#conversations .conv", has_text="dragon").click()
    wait_until(lambda: len(content.inner_text()) > 200, 60, "more of the story")
    expect(answers(page).nth(0)).to_have_class(re.compile(r"\bstreaming\b"))
    # saved while it streams: a reload keeps what had come, marked stopped, and the server aborts it
    wait_until(lambda: len(page.evaluate(saved)) > n + 150, 10, "a save while streaming")
    page.reload()
    expect(answers(page).nth(0).locator(".stats")).to_contain_text("stopped")
    assert len(answers(page).nth(0).locator(".content").inner_text()) > 100
    wait_until(lambda: server.metrics()["prefixkv_kv_blocks_used"] == 0, 10, "the reload to end the request")
    # the next turn leaves out nothing, and deleting a streaming conversation stops its request
    say(page, "Go on.")
    expect(answers(page).nth(1).locator(".content")).not_to_be_empty(timeout=60_000)
    page.locator("#conversations .delete").first.click()
    wait_until(lambda: server.metrics()["prefixkv_kv_blocks_used"] == 0, 10, "the delete to end the request")
    # gone from storage too (the empty chat made above was never saved: nothing to keep)
    assert page.evaluate("Object.keys(localStorage).filter(k => k.startsWith('prefixkv.conv.')).length") == 0
    expect(page.locator("#conversations .conv")).to_have_text(["New chat"])
    expect(page.locator("#send")).to_be_enabled()
    assert page.evaluate("document.activeElement.id") == "input"


def test_two_tabs_keep_each_others_conversations(server, browser):
    context = browser.new_context()
    a, b = context.new_page(), context.new_page()
    for pg in (a, b):
        pg.goto(server.url + "/")
        settings(pg, max_tokens="6")
    say(a, "Hello from tab A")
    say(b, "Hello from tab B")
    wait_answer(a, 1)
    wait_answer(b, 1)
    for pg in (a, b):  # each tab lists both (the other's arrived by the storage event)
        expect(pg.locator("#conversations .conv", has_text="tab A")).to_have_count(1)
        expect(pg.locator("#conversations .conv", has_text="tab B")).to_have_count(1)
    a.reload()
    expect(a.locator("#conversations .conv", has_text="tab B")).to_have_count(1)
    context.close()
