import { formatBytes, formatDuration, formatPercent } from '../format';

describe('format', () => {
  it('formats bytes in decimal units', () => {
    expect(formatBytes(0)).toBe('0 B');
    expect(formatBytes(999)).toBe('999 B');
    expect(formatBytes(1500)).toBe('1.50 KB');
    expect(formatBytes(123_400_000)).toBe('123 MB');
    expect(formatBytes(16e9)).toBe('16.0 GB');
    expect(formatBytes(null)).toBe('–');
  });

  it('formats durations', () => {
    expect(formatDuration(0.123)).toBe('0.12 s');
    expect(formatDuration(4.25)).toBe('4.3 s');
    expect(formatDuration(42)).toBe('42 s');
    expect(formatDuration(185)).toBe('3m 05s');
    expect(formatDuration(2 * 3600 + 600)).toBe('2h 10m');
    expect(formatDuration(3 * 86400 + 4 * 3600)).toBe('3d 4h');
    expect(formatDuration(undefined)).toBe('–');
  });

  it('formats percentages', () => {
    expect(formatPercent(41.6)).toBe('42 %');
    expect(formatPercent(null)).toBe('–');
  });
});
