"""moto's S3 server, one request at a time: moto_serial.py HOST PORT.

moto's server handles requests on threads, and its in-memory backend checks a conditional PUT's
precondition (If-None-Match: *) and stores the object in two steps without a lock, so two racing
create-if-absent PUTs could both succeed (tests/test_store.py's race saw it once under load; S3
makes each request atomic). Here each request runs whole under one lock, connections still on
threads, so the server behaves as S3 does for what the tests race.
"""

import io
import os
import sys
import threading

from werkzeug.serving import run_simple
from werkzeug.wsgi import get_input_stream

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app


def main(host: str, port: int) -> None:
    os.environ.setdefault("MOTO_PORT", str(port))
    app = DomainDispatcherApplication(create_backend_app)
    app.debug = True
    lock = threading.Lock()

    def one_at_a_time(environ, start_response):
        # The request's body is read before the lock (a test's relay may stall it midway: other requests
        # go on meanwhile), the response whole within it (moto's bodies are in memory).
        body = get_input_stream(environ).read()
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        environ.pop("HTTP_TRANSFER_ENCODING", None)
        environ["wsgi.input_terminated"] = False
        with lock:
            return list(app(environ, start_response))

    run_simple(host, port, one_at_a_time, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
