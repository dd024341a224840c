"""meshtron.pipeline"""
