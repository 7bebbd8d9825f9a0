"""The Textual chat app: `statechat run`."""
