"""The task as the workspace keeps it: its state and JSON document, experiment rows, the diagnosis and replays logged
into it, the preserved copies it uses, the evidence behind an attempt."""
