"""Streamlit entry script: ``streamlit run app.py`` (``draftwise dashboard`` does this for you)."""

from draftwise.dashboard.page import main

main()
