"""The three data loaders' downloads (Fashion-MNIST, CIFAR-10, Tiny Shakespeare), never over the real network.

A local HTTP server on 127.0.0.1 (port 0, in a thread) serves small files
written here; each loader's URL, checksums, Debian/cache paths are
monkeypatched to it and to ``tmp_path``.  "Offline" is a URL on a port that was
just bound and closed (connection refused).  Every test runs in well under a
second.
"""

import gzip
import hashlib
import http.server
import io
import pickle
import socket
import tarfile
import threading
import time

import numpy as np
import pytest

from experiments import cifar10, data
from experiments.lm import data as lm_data

# ----------------------------------------------------------------------------- the local server


class Server:
    """A threaded HTTP server on 127.0.0.1 serving ``files`` (URL path -> bytes); ``requests`` lists the paths asked for.

    ``delay`` seconds are slept before answering; ``truncate`` announces 100
    more bytes in ``Content-Length`` than it sends.
    """

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.requests: list[str] = []
        self.delay = 0.0
        self.truncate = False
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append(self.path)
                time.sleep(outer.delay)
                body = outer.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body) + 100 * outer.truncate))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (the timeout test)
                    pass

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.01,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(monkeypatch):
    for var in ("no_proxy", "NO_PROXY"):  # a developer's http_proxy must not take our 127.0.0.1 requests
        monkeypatch.setenv(var, "127.0.0.1,localhost")
    s = Server()
    yield s
    s.close()


def closed_port_url() -> str:
    """A URL on a port nothing listens on: bound, then closed (the connection is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def files_in(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# ----------------------------------------------------------------------------- the three datasets, small


def idx_bytes(arr: np.ndarray) -> bytes:
    return bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape) + arr.tobytes()


class FashionMNIST:
    """20 training and 10 test images, gzipped IDX files served under /fmnist/."""

    def __init__(self, monkeypatch, tmp_path, server):
        rng = np.random.default_rng(0)
        self.arrays, files = {}, {}
        for split, n in (("train", 20), ("t10k", 10)):
            self.arrays[f"{split}-images-idx3-ubyte"] = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
            self.arrays[f"{split}-labels-idx1-ubyte"] = rng.integers(0, 10, n, dtype=np.uint8)
        for name, arr in self.arrays.items():
            raw = idx_bytes(arr)
            files[name] = hashlib.md5(raw).hexdigest()
            server.files[f"/fmnist/{name}.gz"] = gzip.compress(raw)
        self.server = server
        self.cache = tmp_path / "cache" / "fashion-mnist"
        monkeypatch.setattr(data, "FILES", files)
        monkeypatch.setattr(data, "DEBIAN_DIR", tmp_path / "debian")  # absent: the package is not installed
        monkeypatch.setattr(data, "CACHE_DIR", self.cache)
        self.monkeypatch = monkeypatch
        self.set_url(server.url)
        self.downloaded = sorted(f"{name}.gz" for name in files)
        self.hints = ["apt-get install dataset-fashion-mnist", "--data-dir DIR", "connect to the internet"]

    def set_url(self, base):
        self.monkeypatch.setattr(data, "URL", base + "/fmnist/")

    def load(self, root=None, download=True):
        return data.load_fashion_mnist(root, download=download)

    def check(self, got):
        x_train, y_train, x_test, y_test = got
        assert x_train.shape == (20, 28, 28, 1) and x_test.shape == (10, 28, 28, 1)
        assert x_train.dtype == np.float32 and y_train.dtype == np.int32
        np.testing.assert_array_equal(x_train[..., 0], self.arrays["train-images-idx3-ubyte"] / np.float32(255))
        np.testing.assert_array_equal(y_test, self.arrays["t10k-labels-idx1-ubyte"])

    def corrupt_served(self):
        """Serve valid gzip of other content: only the MD5 can tell."""
        for path, body in self.server.files.items():
            raw = bytearray(gzip.decompress(body))
            raw[-1] ^= 0xFF
            self.server.files[path] = gzip.compress(bytes(raw))

    def corrupt_cache(self):
        """Put every file in the cache, then truncate one (an interrupted copy); returns that file."""
        self.cache.mkdir(parents=True)
        for path, body in self.server.files.items():
            (self.cache / path.rsplit("/", 1)[1]).write_bytes(body)
        bad = self.cache / "train-images-idx3-ubyte.gz"
        bad.write_bytes(bad.read_bytes()[:-50])
        return bad

    def explicit(self, tmp_path):
        """``(root argument, folder the files go to)``."""
        return tmp_path / "mine", tmp_path / "mine"


class Cifar10:
    """Two records per batch file, in a tarball served at /cifar/cifar-10-binary.tar.gz."""

    n = 2

    def __init__(self, monkeypatch, tmp_path, server):
        rng = np.random.default_rng(1)
        buf = io.BytesIO()
        self.labels = {}
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for name in cifar10.TRAIN_FILES + cifar10.TEST_FILES:
                labels = rng.integers(0, 10, self.n, dtype=np.uint8)
                pixels = rng.integers(0, 256, (self.n, 3072), dtype=np.uint8)
                raw = np.concatenate([labels[:, None], pixels], axis=1).tobytes()
                self.labels[name] = labels
                info = tarfile.TarInfo(f"{cifar10.FOLDER}/{name}")
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
        tarball = buf.getvalue()
        server.files["/cifar/" + cifar10.ARCHIVE] = tarball
        self.server = server
        self.cache = tmp_path / "cache" / "cifar-10"
        monkeypatch.setattr(cifar10, "FILE_BYTES", self.n * cifar10.RECORD_BYTES)
        monkeypatch.setattr(cifar10, "ARCHIVE_MD5", hashlib.md5(tarball).hexdigest())
        monkeypatch.setattr(cifar10, "CACHE_DIR", self.cache)
        self.monkeypatch = monkeypatch
        self.set_url(server.url)
        self.downloaded = [cifar10.ARCHIVE]
        self.hints = ["--data-dir DIR", "connect to the internet"]

    def set_url(self, base):
        self.monkeypatch.setattr(cifar10, "URL", f"{base}/cifar/{cifar10.ARCHIVE}")

    def load(self, root=None, download=True):
        return cifar10.load_cifar10(root, download=download)

    def check(self, got):
        x_train, y_train, x_test, y_test = got
        assert x_train.shape == (5 * self.n, 32, 32, 3) and x_test.shape == (self.n, 32, 32, 3)
        assert x_train.dtype == np.float32 and y_train.dtype == np.int32
        np.testing.assert_array_equal(y_train, np.concatenate([self.labels[n] for n in cifar10.TRAIN_FILES]))
        np.testing.assert_array_equal(y_test, self.labels["test_batch.bin"])

    def corrupt_served(self):
        path = "/cifar/" + cifar10.ARCHIVE
        body = bytearray(self.server.files[path])
        body[len(body) // 2] ^= 0xFF
        self.server.files[path] = bytes(body)

    def corrupt_cache(self):
        self.cache.mkdir(parents=True)
        bad = self.cache / cifar10.ARCHIVE
        bad.write_bytes(self.server.files["/cifar/" + cifar10.ARCHIVE][:-100])
        return bad

    def explicit(self, tmp_path):
        return tmp_path / "mine", tmp_path / "mine"


class TinyShakespeare:
    """A few hundred characters served at /tiny/input.txt."""

    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 5

    def __init__(self, monkeypatch, tmp_path, server):
        raw = self.text.encode()
        server.files["/tiny/input.txt"] = raw
        self.server = server
        self.cache = tmp_path / "cache"
        monkeypatch.delenv(lm_data.ENV_VAR, raising=False)
        monkeypatch.setattr(lm_data, "SHA256", hashlib.sha256(raw).hexdigest())
        monkeypatch.setattr(lm_data, "CACHE_PATH", self.cache / "tinyshakespeare.txt")
        self.monkeypatch = monkeypatch
        self.set_url(server.url)
        self.downloaded = ["tinyshakespeare.txt"]
        self.hints = ["COMPJAX_TINYSHAKESPEARE=FILE", "connect to the internet"]

    def set_url(self, base):
        self.monkeypatch.setattr(lm_data, "URL", f"{base}/tiny/input.txt")

    def load(self, root=None, download=True):
        return lm_data.load_text(root, download=download)

    def check(self, got):
        assert got == self.text

    def corrupt_served(self):
        self.server.files["/tiny/input.txt"] = self.text.replace("First", "Second").encode()

    def corrupt_cache(self):
        self.cache.mkdir(parents=True)
        bad = self.cache / "tinyshakespeare.txt"
        bad.write_text(self.text[:-10])
        return bad

    def explicit(self, tmp_path):
        return tmp_path / "mine" / "tinyshakespeare.txt", tmp_path / "mine"


@pytest.fixture(params=[FashionMNIST, Cifar10, TinyShakespeare], ids=["fashion_mnist", "cifar10", "tinyshakespeare"])
def case(request, monkeypatch, tmp_path, server):
    return request.param(monkeypatch, tmp_path, server)


# ----------------------------------------------------------------------------- the tests


def test_downloads_verifies_then_reads_the_cache(case, server):
    """(a) Nothing on disk: download into the cache, check, load; a second load asks the server for nothing."""
    case.check(case.load())
    assert len(server.requests) == len(case.downloaded)
    assert files_in(case.cache) == case.downloaded  # no .part left
    server.requests.clear()
    case.check(case.load())
    assert server.requests == []


def test_bad_download_raises_and_leaves_no_file(case, server):
    """(b) The server's bytes have the wrong digest: ChecksumError naming the URL and both digests; no file."""
    case.corrupt_served()
    with pytest.raises(data.ChecksumError) as err:
        case.load()
    msg = str(err.value)
    assert server.url in msg and "expected" in msg
    digests = [w for w in msg.replace(",", " ").split() if len(w) in (32, 64) and set(w) <= set("0123456789abcdef")]
    assert len(set(digests)) == 2, msg  # the one found and the one expected
    assert files_in(case.cache) == []


def test_offline_is_one_line_with_the_reason_and_hints(case, server, tmp_path):
    """(c) No server: DataUnavailable (a FileNotFoundError) whose message is one line with the reason and hints."""
    case.set_url(closed_port_url())
    with pytest.raises(data.DataUnavailable) as err:
        case.load()
    msg = str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    assert "\n" not in msg and "Connection refused" in msg and str(case.cache) in msg
    for hint in case.hints:
        assert hint in msg
    assert files_in(case.cache) == []
    assert server.requests == []


def test_explicit_root_downloads_into_it(case, server, tmp_path):
    """(d) An explicit root (--data-dir) without the files: they are downloaded into it, not into the cache."""
    root, folder = case.explicit(tmp_path)
    case.check(case.load(root))
    assert files_in(folder) == case.downloaded
    assert files_in(case.cache) == []
    server.requests.clear()
    case.check(case.load(root))
    assert server.requests == []


def test_download_false_asks_nothing(case, server, tmp_path):
    """(e) download=False: DataUnavailable saying downloads are disabled, and no request at all."""
    for root in (None, case.explicit(tmp_path)[0]):
        with pytest.raises(data.DataUnavailable, match=r"download=False") as err:
            case.load(root, download=False)
        assert "\n" not in str(err.value) and server.url in str(err.value)  # the URL to fetch by hand
    assert server.requests == []
    assert files_in(case.cache) == [] and not (tmp_path / "mine").exists()


def test_corrupt_cache_file_says_delete_it(case, server):
    """A truncated file in the cache: ChecksumError with its path and the advice to delete it; it is not replaced."""
    bad = case.corrupt_cache()
    before = bad.read_bytes()
    with pytest.raises(data.ChecksumError) as err:
        case.load()
    assert str(bad) in str(err.value) and "delete it" in str(err.value)
    assert server.requests == [] and bad.read_bytes() == before


def test_http_error_and_short_body(case, server):
    """A 404, and a body shorter than its Content-Length: DataUnavailable with the reason; no file left."""
    served = dict(server.files)
    server.files.clear()
    with pytest.raises(data.DataUnavailable, match="HTTP Error 404"):
        case.load()
    server.files.update(served)
    server.truncate = True
    with pytest.raises(data.DataUnavailable, match="closed after"):
        case.load()
    assert files_in(case.cache) == []


def test_timeout(monkeypatch, tmp_path, server):
    """A server that does not answer within TIMEOUT: DataUnavailable 'timed out' (one loader suffices: one fetch).

    The server would answer after 1 s: without the 0.1 s timeout the load succeeds and the test fails."""
    case = TinyShakespeare(monkeypatch, tmp_path, server)
    monkeypatch.setattr(data, "TIMEOUT", 0.1)
    server.delay = 1.0
    with pytest.raises(data.DataUnavailable, match="timed out"):
        case.load()
    assert files_in(case.cache) == []


def test_lm_folder_path_and_shared_exceptions(monkeypatch, tmp_path, server):
    """Tiny Shakespeare: a folder as the path means its tinyshakespeare.txt; the loaders share one exception each."""
    case = TinyShakespeare(monkeypatch, tmp_path, server)
    (tmp_path / "dir").mkdir()
    case.check(lm_data.load_text(tmp_path / "dir"))
    assert files_in(tmp_path / "dir") == ["tinyshakespeare.txt"]
    assert lm_data.ChecksumError is data.ChecksumError and lm_data.DataUnavailable is data.DataUnavailable
    assert cifar10.ChecksumError is data.ChecksumError and cifar10.DataUnavailable is data.DataUnavailable


def test_data_unavailable_message_and_pickle():
    err = data.DataUnavailable("X file a.gz", ["/p", "/q"], None, ["pass --data-dir DIR\nholding it"])
    assert str(err) == ("X file a.gz is not available: not in /p, /q, and downloads are disabled (download=False); "
                        "to get it: pass --data-dir DIR holding it, or allow the download (download=True)")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is data.DataUnavailable and str(again) == str(err)
    err = data.DataUnavailable("X", [], "the download of U failed (boom)", url="U")
    assert str(err) == "X is not available: the download of U failed (boom); to get it: connect to the internet and retry"
    assert pickle.loads(pickle.dumps(err)).url == "U"


# ----------------------------------------------------------------------------- the main job's first run


@pytest.mark.slow  # a main-job run
def test_the_first_main_job_run_downloads_verifies_and_trains(monkeypatch, tmp_path, server, capsys):
    """No Debian package, an empty cache: ``python -m experiments.train`` fetches, checks and trains."""
    from experiments import records, train

    fm = FashionMNIST(monkeypatch, tmp_path, server)
    monkeypatch.setattr(records, "RUNS", tmp_path / "runs")
    summary = train.main(["--epochs", "1", "--batch-size", "16", "--no-progress"])
    assert files_in(fm.cache) == fm.downloaded and len(server.requests) == 4
    assert summary["steps"] == 1 and summary["config"]["train_images"] == 20
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    assert "downloading" in capsys.readouterr().err


def test_the_main_job_offline_exits_with_one_line(monkeypatch, tmp_path, server):
    from experiments import train

    fm = FashionMNIST(monkeypatch, tmp_path, server)
    fm.set_url(closed_port_url())
    with pytest.raises(SystemExit) as exit_:
        train.main(["--epochs", "1", "--batch-size", "16", "--no-progress", "--out", str(tmp_path / "r.jsonl")])
    message = str(exit_.value.code)
    assert "\n" not in message and "apt-get install dataset-fashion-mnist" in message
    assert "--data-dir" in message and files_in(fm.cache) == []
    assert not (tmp_path / "r.jsonl").exists()  # nothing written: the data fails before the run starts
