"""Files written safely: atomic writes, locks, private dirs and files, temp dirs that go when their owner dies."""
