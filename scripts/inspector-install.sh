#!/usr/bin/env bash
# Installs the MCP Inspector (its CLI) into .venv/mcp-inspector for the test that connects it to `mcp --http`
# with the bearer header. Best effort: without node and npm, or offline, that one test is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${AXRL_VENV:-.venv}/mcp-inspector"
VERSION="0.22.0"  # the v1 CLI (--cli URL --transport http --header ...); it runs on Node 20 and later
if [ -x "$DIR/node_modules/.bin/mcp-inspector" ] && grep -q "\"version\": \"$VERSION\"" \
  "$DIR/node_modules/@modelcontextprotocol/inspector/package.json" 2>/dev/null; then exit 0; fi
if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  echo "node/npm not found: the MCP Inspector test will be skipped" >&2
  exit 0
fi
echo "inspector-install: installing the MCP Inspector $VERSION (npm, into $DIR, not system-wide): the HTTP client" \
  "test connects it to \`mcp --http\` with the bearer header" >&2
mkdir -p "$DIR"
timeout 600 npm install --prefix "$DIR" --no-audit --no-fund --loglevel=error \
  "@modelcontextprotocol/inspector@$VERSION" >&2 \
  || echo "MCP Inspector install failed: its test will be skipped" >&2
