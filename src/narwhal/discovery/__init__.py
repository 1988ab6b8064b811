"""Discovery (DESIGN §10): engines found in DNS and in a watched file, each source's answer a
list of engine configs. No policy here: `control/discovery.py` turns answers into membership
changes."""
