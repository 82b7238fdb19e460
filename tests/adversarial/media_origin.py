"""A loopback HTTP origin for the media tests: fixed routes, redirects, errors, a stalled body.

The standard library's threading server, on 127.0.0.1 and an ephemeral port:
the media fetcher under test is trio code and the servicer a subprocess, so
the origin runs beside both in threads of its own (test code only). A
stalled route holds its response until the origin stops, so a fetch
timeout is what ends it, not a sleep.
"""

from __future__ import annotations

import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image


def png_bytes(size: tuple[int, int] = (8, 8), color=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


PNG = png_bytes()


class Origin:
    """Routes: path → (status, headers, body); ``stall`` paths send headers and then nothing."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {
            "/cat.png": (200, {"Content-Type": "image/png"}, PNG),
            "/page.html": (200, {"Content-Type": "text/html"}, b"<html>not an image</html>"),
            "/missing.png": (404, {}, b"no"),
            "/broken.png": (500, {}, b"oops"),
        }
        self.stall_paths: set[str] = {"/slow.png"}
        self.unbounded_paths: set[str] = {"/endless.png"}  # chunked, no Content-Length, never ends
        self.hits: list[str] = []
        self._stop = threading.Event()
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                origin.hits.append(self.path)
                if self.path in origin.stall_paths:
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    self.wfile.write(PNG[:10])
                    self.wfile.flush()
                    origin._stop.wait(60)
                    return
                if self.path in origin.unbounded_paths:
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    chunk = b"\0" * 65536
                    try:
                        while not origin._stop.is_set():
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    except OSError:
                        return  # the fetcher hung up: what it should do
                    return
                status, headers, body = origin.routes.get(self.path, (404, {}, b"no such route"))
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="media-origin")

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def redirect(self, path: str, location: str, status: int = 302) -> None:
        self.routes[path] = (status, {"Location": location}, b"")

    def __enter__(self) -> "Origin":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)
