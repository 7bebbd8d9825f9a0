"""Conversations: chat-template rendering (and, with the app, conversation trees)."""
