"""Run by the vLLM environment's Python for tests/helpers.py `vllm_script`: imports vLLM once (about 6 s on a 2-core
machine, most of a short vLLM script's run), then runs each script the test process sends in a child forked from
this warm process, as `python SCRIPT ARGS...` (or `python -c CODE`) would: its own argv, environment, working
directory, stdout and stderr files, exit code. One script at a time; nothing is run in this process itself, so a
script's patches of vLLM's code stay in its child.

Protocol: one JSON request a line on stdin ({"argv", "env", "cwd", "stdout", "stderr"}); on the file descriptor named
by argv[1], the child's pid as it starts ({"pid"}) and its exit status when it ends ({"returncode"}), one JSON line
each. End of stdin ends this process."""

import atexit
import json
import os
import runpy
import sys
import traceback

import vllm  # noqa: F401  (what every script imports first: the slow part, done once)
from vllm import LLM, SamplingParams  # noqa: F401


def run_child(request: dict) -> int:
    """In the forked child: `request`'s script as __main__; its exit code."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = request["argv"]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:0] = ["", *extra]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path[:0] = [os.path.dirname(os.path.abspath(argv[0])), *extra]
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as stop:
        code = stop.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> None:
    replies = os.fdopen(int(sys.argv[1]), "w")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            code = run_child(request)
            atexit._run_exitfuncs()  # what the interpreter's own exit runs (the script's engines' shutdown)
            os._exit(code)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
