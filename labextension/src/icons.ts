import { LabIcon } from '@jupyterlab/ui-components';

const SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M12 2a10 10 0 1 0 0 20 10 10 0 0 0 0-20zm0 18a8 8 0 1 1 0-16 8 8 0 0 1 0 16z"/>
    <rect x="8.5" y="7.5" width="2.5" height="9" rx="0.5"/>
    <rect x="13" y="7.5" width="2.5" height="9" rx="0.5"/>
  </g>
</svg>`;

/** The extension's icon: a paused kernel. */
export const cedanaIcon = new LabIcon({
  name: 'jupyter-cedana:icon',
  svgstr: SVG
});
