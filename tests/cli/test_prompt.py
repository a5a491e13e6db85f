"""What goes in and out of a session through the CLI: prompt options in command-line order (text,
files, stdin, media with their MIME types and size limit), where `--thinking` prints the model's
reasoning, and result files (JSON, text, stdin, `--error`)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import redis

from tests.cli.probe import tool_messages, write_probe_agent
from tests.cli.process import agents, check_error, check_view, ok, poll, snapshot
from tests.support.llm_server import LlmServer, calls, text

pytestmark = pytest.mark.usefixtures("cli_worker")

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)


def test_prompt_parts_reach_the_model_in_command_line_order(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    scenario = llm_server.scenario([text("seen")])
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url)
    (tmp_path / "notes.txt").write_text("from a file\n")
    (tmp_path / "pixel.png").write_bytes(PNG)
    (tmp_path / "report.pdf").write_bytes(b"%PDF-1.4 tiny")
    run = agents(
        "run",
        "--agent-file",
        agent,
        "-p",
        "first",
        "--media",
        tmp_path / "pixel.png",
        "--file",
        tmp_path / "notes.txt",
        "-p",
        "third",
        "--media",
        tmp_path / "report.pdf",
        "--file",
        "-",
        "--json",
        env=qenv,
        stdin="from stdin\n",
    )
    assert check_view(ok(run))["response"] == "seen"
    (request,) = llm_server.requests[scenario]
    content = request["messages"][-1]["content"]
    assert content[0] == {"type": "text", "text": "first\n\nfrom a file\n\nthird\n\nfrom stdin"}
    assert content[1]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert content[2]["type"] == "file"
    assert content[2]["file"]["file_data"].startswith("data:application/pdf;base64,")
    shown = ok(agents("session", "show", run.doc["session_id"], "--json", env=qenv))
    media = shown["turns"][0]["query"]["media"]
    assert [(m["mime_type"], m["filename"]) for m in media] == [
        ("image/png", "pixel.png"),
        ("application/pdf", "report.pdf"),
    ]


def test_an_unknown_kind_of_file_is_sent_as_octet_stream(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    agent, _ = write_probe_agent(tmp_path, llm_server.scenario([text("-")]), llm_server.url)
    (tmp_path / "blob.zzz").write_bytes(b"\x00\x01\x02")
    view = ok(agents("session", "start", "--agent-file", agent, "--media", tmp_path / "blob.zzz", "--json", env=qenv))
    shown = ok(agents("session", "show", view["session_id"], "--json", env=qenv))
    (media,) = shown["turns"][0]["query"]["media"]
    assert media["mime_type"] == "application/octet-stream"
    assert base64.b64decode(media["data_base64"]) == b"\x00\x01\x02"


def test_media_too_big_or_empty_is_refused_before_anything_is_stored(
    llm_server: LlmServer, qenv: dict[str, str], cli_redis: redis.Redis, cli_prefix: str, tmp_path: Path
) -> None:
    agent, _ = write_probe_agent(tmp_path, llm_server.scenario([text("-")]), llm_server.url)
    eleven = tmp_path / "eleven.png"
    eleven.write_bytes(b"x" * 11)
    huge = tmp_path / "huge.png"
    with huge.open("wb") as f:
        f.truncate(20 * 1024 * 1024 + 1)  # sparse: one byte over the default limit
    (tmp_path / "empty.png").touch()
    before = snapshot(cli_redis, cli_prefix)
    lowered = {**qenv, "AGENTS_MEDIA_MAX_BYTES": "10"}
    for media, env in (
        (eleven, lowered),
        (huge, qenv),
        (tmp_path / "empty.png", qenv),
        (tmp_path / "absent.png", qenv),
    ):
        run = agents("session", "start", "--agent-file", agent, "-p", "look", "--media", media, "--json", env=env)
        error = check_error(run, "invalid_input")
        assert media.name in error["message"]
    assert (
        "AGENTS_MEDIA_MAX_BYTES"
        in agents("run", "--agent-file", agent, "--media", eleven, "--json", env=lowered).doc["error"]["message"]
    )
    assert snapshot(cli_redis, cli_prefix) == before
    ok(agents("session", "start", "--agent-file", agent, "--media", eleven, "--json", env=qenv))


def test_thinking_goes_where_asked(llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path) -> None:
    scenario = llm_server.scenario([text("It is sunny.", reasoning="I ponder the sky")])
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url)
    ask = ("run", "--agent-file", agent, "-p", "weather?")
    to_stdout = agents(*ask, "--thinking", "stdout", env=qenv)
    assert to_stdout.returncode == 0, str(to_stdout)
    assert "I ponder the sky" in to_stdout.stdout and to_stdout.stdout.rstrip().endswith("It is sunny.")
    assert "I ponder the sky" not in to_stdout.stderr
    to_stderr = agents(*ask, "--thinking", "stderr", env=qenv)
    assert to_stderr.stdout == "It is sunny.\n" and "I ponder the sky" in to_stderr.stderr, str(to_stderr)
    nowhere = agents(*ask, "--thinking", "none", env=qenv)
    assert nowhere.stdout == "It is sunny.\n", str(nowhere)
    assert "I ponder the sky" not in nowhere.stderr
    as_json = agents(*ask, "--thinking", "stdout", "--json", env=qenv)
    assert ok(as_json)["response"] == "It is sunny."  # still exactly one JSON document


def test_result_files_json_text_stdin_and_error(llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path) -> None:
    scenario = llm_server.scenario(
        [
            calls(
                ("approve", {"x": "json"}),
                ("approve", {"x": "text"}),
                ("approve", {"x": "stdin"}),
                ("approve", {"x": "error"}),
            ),
            text("settled"),
        ]
    )
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url)
    view = ok(agents("session", "start", "--agent-file", agent, "-p", "four approvals", "--run", "--json", env=qenv))
    sid = view["session_id"]
    tokens = {p["arguments"]["x"]: p["token"] for p in view["pending"]}
    assert set(tokens) == {"json", "text", "stdin", "error"}
    (tmp_path / "r.json").write_text('{"approved": true, "seats": 2}\n')
    (tmp_path / "r.txt").write_text("   looks good to me  \n\n")
    (tmp_path / "why.txt").write_text("  no budget left \n")
    first = ok(agents("session", "complete", tokens["json"], tmp_path / "r.json", "--json", env=qenv))
    assert (first["remaining"], first["woken"]) == (3, False)
    ok(agents("session", "complete", tokens["text"], tmp_path / "r.txt", "--json", env=qenv))
    ok(agents("session", "complete", tokens["stdin"], "-", "--json", env=qenv, stdin='"quoted"\n'))
    last = ok(agents("session", "complete", tokens["error"], tmp_path / "why.txt", "--error", "--json", env=qenv))
    assert (last["remaining"], last["woken"]) == (0, True)

    done = poll(
        lambda: (v := ok(agents("session", "show", sid, "--json", env=qenv)))["state"] == "completed" and v,
        "the session to finish once its last call is complete",
        every=0.1,
    )
    assert done["response"] == "settled"
    outcomes = [(c["arguments"]["x"], c["state"], c.get("result"), c.get("error")) for c in done["calls"]]
    assert outcomes == [
        ("json", "completed", {"approved": True, "seats": 2}, None),
        ("text", "completed", "looks good to me", None),
        ("stdin", "completed", "quoted", None),
        ("error", "failed", None, "no budget left"),
    ]
    last_request = llm_server.requests[scenario][-1]
    assert [m["content"] for m in tool_messages(last_request)] == [
        json.dumps({"approved": True, "seats": 2}),
        "looks good to me",
        "quoted",
        "Error: no budget left",
    ]
