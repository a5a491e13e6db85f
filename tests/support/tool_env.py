"""Tool programs that report the environment a tool runs with (the trust tests read it)."""

ENVTOOL = """
import json, os, subprocess, sys

def dump() -> dict:
    \"\"\"What a python tool sees of the environment, and what a program it starts gets.\"\"\"
    child = subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
                           capture_output=True, text=True, check=True)
    return {"env": dict(os.environ), "child": json.loads(child.stdout)}
"""
