"""A real headless Chromium page attacking the OpenAI-compatible endpoint during "training": a page on
another origin sends blind cross-site POSTs (a text/plain fetch and an auto-submitted form) to end or
extend a live trajectory, and a DNS-rebinding page (its host name resolving to 127.0.0.1, so it shares
the endpoint's origin under the attacker's name) tries to read the trajectory back. The page even
knows the trajectory's id (a worst case: ids are unguessable). Nothing it sends may reach the recorder."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from tests.view.browser import need_browser
from tests.view.rebinding import attacker_chromium, read_after_rebinding

from tirl.agent.openai_server import ChatRecorder, OpenAIEndpoint
from tirl.engines import SingleEnginePool, load_tokenizer
from tirl.engines.base import Generation, SamplingParams

pytestmark = pytest.mark.timeout(600)
SECRET = "SECRET-PROBLEM-4242"


class Canned:
    def __init__(self, tokenizer):
        self.ids = tokenizer("ok<|im_end|>", add_special_tokens=False)["input_ids"]
        self.name = "canned"
        self.calls = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.calls += 1
        return Generation(list(self.ids), [-0.5] * len(self.ids), "stop")


@pytest.fixture
def browser():
    need_browser("the endpoint's browser tests")
    with attacker_chromium() as b:
        yield b


@pytest.fixture
def live(tiny_model_dir):
    """An endpoint with one live trajectory whose problem text is SECRET; (endpoint, id, engine)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = Canned(tokenizer)
    endpoint = OpenAIEndpoint(ChatRecorder(SingleEnginePool(engine), tokenizer, max_response_tokens=64))
    tid = endpoint.trajectory_id("train")
    body = {"messages": [{"role": "user", "content": f"Solve {SECRET}."}]}
    assert httpx.post(f"{endpoint.url}/t/{tid}/v1/chat/completions", json=body, timeout=60).status_code == 200
    try:
        yield endpoint, tid, engine
    finally:
        endpoint.close()


class AttackerSite:
    """The attacker's web server (on loopback, reached as http://attacker.test:PORT/)."""

    def __init__(self, html: str):
        page = html.encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://attacker.test:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def cross_site_page(endpoint_url: str, tid: str) -> str:
    """Three blind POSTs a page may send anywhere without the browser asking first, then a read."""
    base = f"{endpoint_url}/t/{tid}"
    extend = json.dumps({"messages": [{"role": "user", "content": f"Solve {SECRET}."}]})
    # A text/plain form whose "name=value" body is JSON: '{"messages": [...], "x": "' + '=' + '"}'
    name, value = extend[:-1] + ', "x": "', '"}'
    return f"""<!doctype html><body>
<iframe name="sink"></iframe>
<form id="f" method="POST" action="{base}/v1/chat/completions" enctype="text/plain" target="sink">
<input name='{name}' value='{value}'></form>
<script>
window.results = {{}};
async function attack() {{
  await fetch("{base}/finish", {{method: "POST", mode: "no-cors", body: "{{}}",
                                 headers: {{"Content-Type": "text/plain"}}}}).catch(() => null);
  await fetch("{base}/v1/chat/completions", {{method: "POST", mode: "no-cors", body: {json.dumps(extend)},
                                 headers: {{"Content-Type": "text/plain"}}}}).catch(() => null);
  document.getElementById("f").submit();
  try {{
    const r = await fetch("{base}/finish", {{method: "POST", body: "{{}}",
                                             headers: {{"Content-Type": "application/json"}}}});
    window.results.read = await r.text();
  }} catch (e) {{ window.results.read = "refused: " + e; }}
  window.results.done = true;
}}
attack();
</script></body>"""


def test_a_cross_site_page_cannot_end_extend_or_read_a_live_trajectory(browser, live):
    endpoint, tid, engine = live
    site = AttackerSite(cross_site_page(endpoint.url, tid))
    try:
        page = browser.new_page()
        page.goto(site.url)
        page.wait_for_function("window.results && window.results.done === true", timeout=60_000)
        page.wait_for_load_state("networkidle")
        read = page.evaluate("window.results.read")
        page.close()
    finally:
        site.close()
    assert SECRET not in read
    rec = endpoint.recorder.recording(tid)  # still live: not ended by the page
    assert engine.calls == 1 and rec.turns == 1, "the page extended the trajectory"


def test_a_dns_rebinding_page_cannot_read_or_end_a_trajectory(browser, live):
    """The page's name resolves to 127.0.0.1 now: it shares the endpoint's origin and could read."""
    endpoint, tid, _ = live
    read = read_after_rebinding(
        browser,
        int(endpoint.url.rsplit(":", 1)[1]),
        f"""fetch("/t/{tid}/finish", {{method: "POST", body: "{{}}", headers: {{"Content-Type": "application/json"}}}})
  .then(r => r.text()).then(t => {{ window.results.read = t; }})
  .catch(e => {{ window.results.read = "refused: " + e; }})
  .finally(() => {{ window.results.done = true; }});""",
    )
    assert SECRET not in read and "prompt_ids" not in read, read[:300]
    assert "not this service" in read, read[:300]
    assert endpoint.recorder.recording(tid).turns == 1, "the page ended the trajectory"
