"""meshtron.layers"""
