"""Pictures of schedules: SVG Gantt charts, Chrome/Perfetto traces and terminal grids."""
