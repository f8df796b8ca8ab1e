"""The MCP face, tool by tool: each module's tools are plain module-level functions that validate, call one library
function and shape its result; its `register(server)` only lists them. `axrl_spike_replay.server` assembles them."""
