"""`cpumla serve` as the tests run it: a server subprocess on a free 127.0.0.1 port with a tiny dummy
model, its stderr (the readiness line and one log line per request) read as it arrives."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

SHRINK = {"num_hidden_layers": 1, "hidden_size": 128, "n_routed_experts": 8, "first_k_dense_replace": 1,
          "q_lora_rank": 64, "num_attention_heads": 2}
V3 = "deepseek-ai/DeepSeek-V3"
V31 = "deepseek-ai/DeepSeek-V3.1"
KEY = "test-key-123"
CTX = 4096
LINE = re.compile(r"^\S+ \S+ 127\.0\.0\.1:\d+ (GET|POST) (\S+) (\d{3})(.*) [\d.]+s$")


class Server:
    """`python -m cpumla serve` on port 0; its stderr read into `lines` as it arrives."""

    def __init__(self, model: str, *extra: str):
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        env.pop("CPUMLA_ISA", None)
        env.pop("CPUMLA_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cpumla", "serve", model, "--dummy-weights", "--hf-overrides", json.dumps(SHRINK),
             "--host", "127.0.0.1", "--port", "0", "--ctx-size", str(CTX), "--threads", "1", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, encoding="utf-8", env=env)
        self.lines: list[str] = []
        self._port = threading.Event()
        self.url = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._port.wait(90):
            self.stop()
            raise RuntimeError("server did not start:\n" + "\n".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.lines.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)/v1", line)
            if m:
                self.url = m.group(1)
                self._port.set()

    def requests(self) -> list[re.Match]:
        """The per-request log lines (after a moment for the last one to be written)."""
        time.sleep(0.2)
        return [m for m in map(LINE.match, self.lines) if m]

    def stop(self) -> int:
        """Ctrl-C: a graceful shutdown, exit status 0."""
        self.proc.send_signal(signal.SIGINT)
        try:
            rc = self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        self._reader.join(5)
        return rc

    def stop_cleanly(self) -> None:
        """stop(), which must exit 0 with the stopped line last and no traceback in the log."""
        rc = self.stop()
        log = "\n".join(self.lines)
        assert rc == 0 and self.lines[-1] == "cpumla serve: stopped", log
        assert "Traceback" not in log, log

    def openai_client(self, key: str = "unused", timeout: float = 120):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, timeout=timeout, max_retries=0)
