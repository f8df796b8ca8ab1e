"""The MCP face, tool by tool: each module declares typed tools that validate, call one library function
and shape its result. `axrl_spike_replay.server` assembles them into the server."""
